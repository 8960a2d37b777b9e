"""Incremental detokenization (TGI's prefix_offset / read_offset technique).

Text is decoded over a sliding window of ids: `prefix_offset..read_offset` is the context already
emitted, `read_offset..` the new ids. New text is released only when the window's decode grows and
does not end in U+FFFD (an incomplete UTF-8 sequence from byte-fallback tokens); `flush()` releases
whatever is held at the end. The window starts in the prompt's tail so the first output token keeps
its leading space for tokenizers that drop it when decoding a lone token.
"""
from __future__ import annotations

_REPLACEMENT = "\ufffd"
_PROMPT_CONTEXT = 5  # prompt ids kept in the initial window


def _backend_decode(tokenizer):
    """The `tokenizers` decode behind a transformers fast tokenizer that does not override
    decoding: what `tokenizer.decode(ids, skip_special_tokens=..., clean_up_tokenization_spaces=False)`
    returns, without the ~6 us of argument handling per call (two calls per token)."""
    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError:  # pragma: no cover
        return None
    cls = type(tokenizer)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if (backend is None or not isinstance(tokenizer, PreTrainedTokenizerFast)
            or cls.decode is not PreTrainedTokenizerFast.decode
            or cls._decode is not PreTrainedTokenizerFast._decode):
        return None
    return backend.decode


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], *, skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        tail = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self.ids: list[int] = tail  # prompt tail + output ids
        self.prefix_offset = 0
        self.read_offset = len(tail)
        self.output_start = len(tail)
        self._prefix_text: str | None = None  # decode(ids[prefix_offset:read_offset]), cached
        self.output_text = ""  # confirmed text so far
        self._backend_decode = _backend_decode(tokenizer)

    def decode(self, ids: list[int]) -> str:
        """What `tokenizer.decode(ids)` gives. spaces_between_special_tokens reaches only
        tokenizers without a `tokenizers` backend, as in transformers and vLLM: a fast tokenizer
        writes special tokens as they are, with no spaces added."""
        if self._backend_decode is not None:
            return self._backend_decode(ids, skip_special_tokens=self.skip_special_tokens)
        kw = {} if self.spaces_between_special_tokens else {"spaces_between_special_tokens": False}
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False, **kw)

    def _window_text(self) -> tuple[str, str]:
        if self._prefix_text is None:
            self._prefix_text = self.decode(self.ids[self.prefix_offset:self.read_offset])
        return self._prefix_text, self.decode(self.ids[self.prefix_offset:])

    def update(self, new_token_ids: list[int]) -> str:
        """Add output ids; return the newly confirmed text ('' while held back)."""
        if not new_token_ids:
            return ""
        self.ids.extend(new_token_ids)
        prefix_text, new_text = self._window_text()
        if len(new_text) > len(prefix_text) and not new_text.endswith(_REPLACEMENT):
            return self._confirm(new_text[len(prefix_text):])
        return ""

    def flush(self) -> str:
        """At finish: release held-back text (an incomplete character decodes to U+FFFD)."""
        if self.read_offset == len(self.ids):
            return ""
        prefix_text, new_text = self._window_text()
        return self._confirm(new_text[len(prefix_text):])

    def _confirm(self, delta: str) -> str:
        """Move the window past every id so far; `delta` is the text they add."""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        self._prefix_text = None
        self.output_text += delta
        return delta

    @property
    def output_token_ids(self) -> list[int]:
        return self.ids[self.output_start:]


DECODE_CONTEXT = 4  # a UTF-8 character is at most 4 bytes, so at most 4 byte tokens


def decoded_token(tokenizer, token_id: int, context: list[int]) -> str:
    """A logprob entry's text: `decode([token_id])`, except for a byte of a character split over
    several tokens (its own decode ends in U+FFFD). Such a token's text is what it adds after
    `context` (the ids before its position): the character it completes, together with the byte
    tokens before it (which read ""), or "" while the character is still incomplete, as vLLM
    reports them."""
    text = tokenizer.decode([token_id])
    if not text.endswith(_REPLACEMENT):
        return text
    for n in range(1, min(len(context), DECODE_CONTEXT) + 1):
        ctx = context[-n:]
        full = tokenizer.decode(ctx + [token_id])
        if full.endswith(_REPLACEMENT):
            continue
        clean = len(ctx)  # the context before the byte tokens this one completes
        while clean and tokenizer.decode([ctx[clean - 1]]).endswith(_REPLACEMENT):
            clean -= 1
        prefix = tokenizer.decode(ctx[:clean]) if clean else ""
        common = 0
        while common < min(len(prefix), len(full)) and prefix[common] == full[common]:
            common += 1
        return full[common:]
    return ""
