"""Swap-preemption on a tiny random Llama with LoRA adapters (tests/test_feature_combinations_model.py's
fixture): greedy tokens under every adapter equal Hugging Face's on the merged weights when the
pool swaps requests out and back, with and without async scheduling, and seeded sampling with
logprobs gives the samples of a pool that never preempts."""
from __future__ import annotations

import pytest

from llmsvc import SamplingParams
from tests.sample_compare import assert_same_samples
from tests.test_feature_combinations_model import (GREEDY, MAX_NEW, _lora_mix, _prompts, generate,  # noqa: F401
                                                   served)

SWAP = dict(swap_space="4MiB", preemption_mode="swap", num_kv_blocks_override=20)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_swapped_requests_keep_their_adapter(served, async_scheduling):
    _, _, refs = served
    mix = _lora_mix()
    got, stats = generate(served, [_prompts()[p] for p, _ in mix], GREEDY, [n for _, n in mix],
                          async_scheduling=async_scheduling, **SWAP)
    assert [t for t, _, _ in got] == [refs[n][p] for p, n in mix]
    assert stats.extra["swap_outs"] > 0 and stats.extra["num_free_swap_blocks"] == stats.extra["num_swap_blocks"]


def test_seeded_sampling_with_adapters_is_unchanged_by_swapping(served):
    mix = _lora_mix()
    params = [SamplingParams(n=2, max_tokens=MAX_NEW, temperature=0.8, top_p=0.9, seed=i, presence_penalty=0.3,
                             logprobs=2, ignore_eos=True) for i in range(len(mix))]
    args = ([_prompts()[p] for p, _ in mix], params, [n for _, n in mix])
    base, _ = generate(served, *args, detail=True)
    swapped, stats = generate(served, *args, detail=True, **SWAP)
    assert_same_samples(swapped, base)
    assert stats.extra["swap_outs"] > 0
