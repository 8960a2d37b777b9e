"""Sampler under a structured-output bitmask: only allowed tokens are ever sampled (greedy,
random, with penalties / bias / top-k / top-p), unconstrained rows are untouched, logprobs are
taken after the mask, and the caller's logits stay unmodified."""
from __future__ import annotations

import math

import numpy as np
import torch

from llmsvc.sampling_params import SamplingParams
from llmsvc.worker.sampler import Sampler
from llmsvc.worker.sampling_metadata import SamplingMetadata

V = 100


def pack(allowed_rows: list[list[int]], width_tokens: int = V) -> np.ndarray:
    """[R, ceil(width / 32)] int32 bitmask with exactly these tokens allowed per row."""
    bits = np.zeros((len(allowed_rows), -(-width_tokens // 32) * 32), dtype=np.uint8)
    for r, toks in enumerate(allowed_rows):
        bits[r, toks] = 1
    return np.packbits(bits, axis=1, bitorder="little").view(np.int32)


def build(params, req_ids, mask_ids, allowed, width=V):
    n = len(params)
    md = SamplingMetadata.build(params, [[1, 2]] * n, [[3]] * n, V, "cpu",
                                generator=torch.Generator().manual_seed(0))
    md.set_grammar_bitmask(req_ids, mask_ids, pack(allowed, width))
    return md


def test_greedy_picks_the_best_allowed_token_and_leaves_other_rows():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(1))
    before = logits.clone()
    allowed = [5, 17, 64]
    # mask rows arrive in another order than the batch: matched by request id
    md = build([SamplingParams(temperature=0.0)] * 3, ["a", "b", "c"], ["c", "a"], [[7], allowed])
    out = Sampler()(logits, md).sampled_token_ids
    assert out[0] == allowed[int(logits[0, allowed].argmax())]
    assert out[1] == logits[1].argmax()  # unconstrained
    assert out[2] == 7
    assert torch.equal(logits, before)


def test_random_rows_with_every_processor_only_sample_allowed_tokens():
    g = torch.Generator().manual_seed(2)
    allowed = sorted(torch.randperm(V, generator=g)[:9].tolist())
    p = SamplingParams(temperature=1.3, top_k=20, top_p=0.9, min_p=0.01, repetition_penalty=1.2,
                       presence_penalty=0.5, logit_bias={allowed[0]: -3.0, 0: 50.0})
    for seed in range(20):
        logits = torch.randn(4, V, generator=torch.Generator().manual_seed(seed)) * 3
        md = build([p] * 4, ["a", "b", "c", "d"], ["a", "b", "c", "d"], [allowed] * 4)
        out = Sampler()(logits, md).sampled_token_ids.tolist()
        assert all(t in allowed for t in out), (seed, out)


def test_logprobs_are_taken_after_the_mask():
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(3))
    allowed = [3, 9, 40, 41]
    params = [SamplingParams(temperature=0.0, logprobs=5)] * 2
    md = build(params, ["a", "b"], ["a"], [allowed])
    out = Sampler()(logits, md)
    lp = out.logprobs[0]
    expected = torch.log_softmax(logits[0, allowed], dim=-1)
    assert sorted(lp.top_token_ids[:4]) == allowed and lp.top_logprobs[4] == -math.inf
    assert math.isclose(lp.logprob, float(expected.max()), rel_tol=1e-5) and lp.rank == 1
    # the unconstrained row keeps the plain distribution
    assert math.isclose(out.logprobs[1].logprob, float(torch.log_softmax(logits[1], -1).max()), rel_tol=1e-5)


def test_model_vocab_wider_than_the_mask_forbids_the_padding_tokens():
    logits = torch.zeros(1, V)
    logits[0, V - 1] = 100.0  # a padding id past the mask's width would win if unmasked
    md = build([SamplingParams(temperature=0.0)], ["a"], ["a"], [[0, 1, 2]], width=64)
    assert md.grammar_bitmask.shape == (1, 2)
    assert Sampler()(logits, md).sampled_token_ids.tolist() == [0]
