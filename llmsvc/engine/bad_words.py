"""bad_words -> the token sequences the sampler masks (torch-free; runs at admission).

A word can appear in the output as written or, mid-text, after a space, and most BPE
vocabularies spell the two differently (SmolLM2: "Paris" and "ĠParis"). As vLLM does, each word
(its leading spaces stripped) gives its own token sequence, plus the sequence of " " + word
when that one starts with another token and is as long (a longer one is a different split,
not the same word). The sampler then forbids a sequence's last token wherever the output
already ends with the rest of it.
"""
from __future__ import annotations

from collections.abc import Sequence


def bad_words_token_ids(tokenizer, words: Sequence[str]) -> list[list[int]]:
    out: list[list[int]] = []
    for word in words:
        plain = list(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        if not plain:
            continue
        out.append(plain)
        spaced = list(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if len(spaced) == len(plain) and spaced[0] != plain[0]:
            out.append(spaced)
    return out
