"""Vocabulary: a tokenizer's special tokens, as structural tags meet them (torch-free).

A structural tag's strings may spell special tokens of the model ("<|tool_call_begin|>"); those
must match the token itself, never its spelling in plain text. The LLTokenizer the grammar is
compiled for says which tokens are special.
"""
from __future__ import annotations

import functools


class Vocabulary:
    """The model's special tokens, as a structural tag's strings and free text meet them. Built
    from the LLTokenizer the grammar is compiled for; with None, every string is plain text."""

    def __init__(self, tokenizer=None) -> None:
        self.tokenizer = tokenizer
        self.special_ids = _special_ids(tokenizer) if tokenizer is not None else ()

    def spelling(self, token_id: int) -> str:
        """A special token's text ("<|tool_call_end|>")."""
        return self.tokenizer.decode_str([token_id])

    def split(self, s: str) -> list:
        """[plain text | special token id, ...] spelling `s`."""
        if self.tokenizer is None or not s:
            return [s] if s else []
        pieces, at = [], 0
        for t in self.tokenizer.tokenize_str(s, parse_special=True):
            if not self.tokenizer.is_special_token(t):
                continue
            name = self.tokenizer.decode_str([t])
            found = s.find(name, at)
            if found < 0:  # not spelled in the string as it decodes: leave it text
                continue
            if found > at:
                pieces.append(s[at:found])
            pieces.append(t)
            at = found + len(name)
        if at < len(s):
            pieces.append(s[at:])
        return pieces


@functools.lru_cache(maxsize=8)
def _special_ids(tokenizer) -> tuple[int, ...]:
    """The special tokens free text may hold: all but EOS, which ends the output (one pass over
    the vocabulary per tokenizer)."""
    eos = set(tokenizer.eos_tokens)
    return tuple(t for t in range(tokenizer.vocab_size) if tokenizer.is_special_token(t) and t not in eos)


def token_set(ids) -> str:
    """Lark for any one of the token ids, as ranges: <[3,7-9]>."""
    ranges: list[list[int]] = []
    for t in sorted(ids):
        if ranges and ranges[-1][1] == t - 1:
            ranges[-1][1] = t
        else:
            ranges.append([t, t])
    return "<[" + ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in ranges) + "]>"
