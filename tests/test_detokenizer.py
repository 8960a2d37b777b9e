"""Incremental detokenizer on the real SmolLM2 tokenizer (byte-level BPE)."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_fakes import smollm2_tokenizer
from llmsvc.engine.detokenizer import IncrementalDetokenizer

TEXTS = [
    "Hello 😀 world",
    "你好世界，今天天气很好。",
    "mixed: ñandú 🤖🧠 naïve café — “quotes” end",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 math and \x01\x02 control bytes",
    "👩‍👩‍👧‍👦 family (ZWJ) + flags 🇫🇷🇯🇵",
]


@pytest.fixture(scope="module")
def tok():
    return smollm2_tokenizer()


def stream(tok, ids, prompt=(1, 2, 3), **kw):
    d = IncrementalDetokenizer(tok, list(prompt), **kw)
    deltas = [d.update([i]) for i in ids]
    deltas.append(d.flush())
    return d, deltas


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_concatenate_and_never_split_a_character(tok, text):
    ids = tok.encode(text)
    # byte-level tokens really do split characters here
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    d, deltas = stream(tok, ids)
    assert "".join(deltas) == tok.decode(ids) == text == d.output_text
    assert all("\ufffd" not in x for x in deltas)
    held = [i for i, x in enumerate(deltas[:-1]) if x == ""]
    assert held  # multi-byte characters were held back until complete


def test_multi_token_updates(tok):
    ids = tok.encode(TEXTS[2])
    d = IncrementalDetokenizer(tok, [])
    out = [d.update(ids[i:i + 3]) for i in range(0, len(ids), 3)] + [d.flush()]
    assert "".join(out) == TEXTS[2]


def test_incomplete_character_flushed_at_finish(tok):
    ids = tok.encode("ok 😀")
    d, deltas = stream(tok, ids[:-1])
    assert deltas[-1].endswith("\ufffd")  # released only at flush
    assert "".join(deltas) == tok.decode(ids[:-1])


def test_first_token_keeps_leading_space(tok):
    prompt = tok.encode("The answer is")
    ids = tok.encode(" forty two")
    _, deltas = stream(tok, ids, prompt=prompt)
    assert "".join(deltas) == " forty two"


def test_special_tokens(tok):
    ids = [1] + tok.encode("Hi there") + [2]
    _, skip = stream(tok, ids)
    assert "".join(skip) == "Hi there"
    _, keep = stream(tok, ids, skip_special_tokens=False, spaces_between_special_tokens=False)
    assert "".join(keep) == "<|im_start|>Hi there<|im_end|>"
    _, spaced = stream(tok, ids, skip_special_tokens=False, spaces_between_special_tokens=True)
    # a fast tokenizer adds no spaces around special tokens (transformers' decode, vLLM's fast
    # detokenizer): the text is what decoding the ids gives
    assert "".join(spaced) == "".join(keep) == tok.decode(ids, skip_special_tokens=False)


@settings(max_examples=40, deadline=None)
@given(st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=30))
def test_any_text_roundtrips_through_deltas(text):
    tok = smollm2_tokenizer()
    ids = tok.encode(text)
    _, deltas = stream(tok, ids)
    assert "".join(deltas) == tok.decode(ids)
    assert all("\ufffd" not in x for x in deltas[:-1]) or "\ufffd" in tok.decode(ids)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 49151), min_size=1, max_size=24), st.booleans())
def test_backend_decode_equals_the_transformers_wrapper(ids, skip):
    """The detokenizer calls the `tokenizers` backend directly when the tokenizer class does not
    override decoding; it must give what `tokenizer.decode` gives, special ids included."""
    tok = smollm2_tokenizer()
    d = IncrementalDetokenizer(tok, [], skip_special_tokens=skip, spaces_between_special_tokens=False)
    assert d._backend_decode is not None
    ids = [1, 2] + ids if skip else ids
    assert d.decode(ids) == tok.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
    _, deltas = stream(tok, ids, prompt=(), skip_special_tokens=skip, spaces_between_special_tokens=False)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)


@pytest.mark.parametrize("text", TEXTS)
def test_decoded_token_of_split_characters(tok, text):
    # a logprob entry's text (vLLM's decoded_token): a byte token reads "" until the token that
    # completes its character, which reads the whole character; so the entries of an output
    # concatenate to its text, and none shows U+FFFD
    from llmsvc.engine.detokenizer import decoded_token
    ids = tok.encode(text)
    entries = [decoded_token(tok, t, ids[:k]) for k, t in enumerate(ids)]
    assert "".join(entries) == text and not any("\ufffd" in e for e in entries)
    assert any(e == "" for e in entries)  # the split characters really were split
    assert all(e == tok.decode([t]) for e, t in zip(entries, ids) if "\ufffd" not in tok.decode([t]))
