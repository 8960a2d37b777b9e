"""Swap space on a tiny random model: the worker's block copies are exact, and greedy tokens with
swap-preemption equal those of a run that never preempts, for every executor (tp: two ranks,
each swapping its own heads), with async scheduling, structured output and the host tier; both
pools are whole at the end."""
from __future__ import annotations

import random

import pytest
import torch

from llmsvc import LLM, SamplingParams
from llmsvc.wire import SchedulerOutput
from llmsvc.worker.kv_swap import KVSwapper, _runs
from tests.server_harness import EOS, make_tiny_served_model_dir

ENGINE = dict(block_size=4, num_kv_blocks_override=36, max_num_batched_tokens=32, max_num_seqs=8)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_served_model_dir(tmp_path_factory.mktemp("swap"))


def test_worker_copies_are_exact_in_order():
    torch.manual_seed(0)
    kv = [(torch.randn(8, 4, 2, 3), torch.randn(8, 4, 2, 3)) for _ in range(3)]
    before = [(k.clone(), v.clone()) for k, v in kv]
    per_block = 2 * 3 * 4 * 2 * 3 * 4
    sw = KVSwapper(kv, 6 * per_block)
    assert sw.num_blocks == 6
    so = SchedulerOutput.make_empty()
    so.blocks_to_swap_out = [(2, 0), (3, 1), (7, 4), (5, 4)]  # the later copy to host 4 wins
    sw.run(so)
    for (hk, hv), (k, v) in zip(sw.host, before):
        assert torch.equal(hk[0], k[2]) and torch.equal(hk[1], k[3]) and torch.equal(hv[4], v[5])
    # swap-outs run before swap-ins: device 2 goes out to host 2 before host 0 (old device 2) comes
    # back into device 3, and copies last
    so = SchedulerOutput.make_empty()
    so.blocks_to_swap_out = [(3, 2)]
    so.blocks_to_swap_in = [(0, 3), (1, 2)]
    so.blocks_to_copy = [(3, 6), (6, 7)]
    sw.run(so)
    for (k, v), (k0, v0), (hk, _) in zip(kv, before, sw.host):
        assert torch.equal(hk[2], k0[3])
        assert torch.equal(k[3], k0[2]) and torch.equal(k[2], k0[3]) and torch.equal(v[3], v0[2])
        assert torch.equal(k[6], k0[2]) and torch.equal(k[7], k0[2])
        assert torch.equal(k[0], k0[0]) and torch.equal(k[1], k0[1])
    assert sw.num_blocks_copied == 4 + 5


def test_runs_coalesce_consecutive_blocks():
    assert _runs([(1, 5), (2, 6), (3, 7), (9, 0), (4, 8)]) == [(1, 5, 3), (9, 0, 1), (4, 8, 1)]
    assert _runs([(0, 1), (1, 2)], coalesce=False) == [(0, 1, 1), (1, 2, 1)]


def test_swap_space_too_large_fails_naming_the_flag():
    kv = [(torch.zeros(2, 4, 1, 2), torch.zeros(2, 4, 1, 2))]
    with pytest.raises(ValueError, match="--swap-space"):
        KVSwapper(kv, 1 << 60)
    with pytest.raises(ValueError, match="--swap-space .* holds no KV block"):
        KVSwapper(kv, 3)


def workload():
    rng = random.Random(3)
    shared = [rng.randrange(3, EOS) for _ in range(12)]
    prompts = [shared + [rng.randrange(3, EOS) for _ in range(n)] for n in (2, 30, 60)]
    prompts += [[rng.randrange(3, EOS) for _ in range(n)] for n in (5, 41, 9)]
    params = [SamplingParams(max_tokens=mt, temperature=0.0, ignore_eos=True) for mt in (24, 1, 18, 16, 20, 20)]
    return prompts, params


def generate(llm: LLM, prompts, params) -> list:
    outs = llm.generate(prompts, params, use_tqdm=False)
    stats = llm.llm_engine.get_stats()
    assert stats.num_free_kv_blocks == stats.num_kv_blocks, "leaked KV blocks"
    if "num_swap_blocks" in stats.extra:
        assert stats.extra["num_swapped"] == 0
        assert stats.extra["num_free_swap_blocks"] == stats.extra["num_swap_blocks"], "leaked host blocks"
    return [[c.token_ids for c in o.outputs] for o in outs]


@pytest.fixture(scope="module")
def reference(model_dir):
    llm = LLM(model=model_dir, **{**ENGINE, "num_kv_blocks_override": 400})
    try:
        prompts, params = workload()
        out = generate(llm, prompts, params)
        assert llm.llm_engine.get_stats().num_preemptions == 0
    finally:
        llm.shutdown()
    return prompts, params, out


@pytest.mark.parametrize("executor,tp,async_scheduling", [("uniproc", 1, False), ("uniproc", 1, True),
                                                          ("multiproc", 1, False), ("tp", 2, True)])
def test_swap_preemption_gives_the_tokens_of_no_preemption(model_dir, reference, executor, tp, async_scheduling):
    prompts, params, expected = reference
    llm = LLM(model=model_dir, executor=executor, tensor_parallel_size=tp, async_scheduling=async_scheduling,
              swap_space="4MiB", preemption_mode="swap", **ENGINE)
    try:
        assert generate(llm, prompts, params) == expected
        extra = llm.llm_engine.get_stats().extra
        assert extra["swap_outs"] > 0 and extra["swap_ins"] == extra["swap_outs"], extra
    finally:
        llm.shutdown()


def test_host_tier_serves_a_returning_prefix(model_dir):
    """A prompt's blocks evicted by other prompts come back from the host tier: fewer prompt
    tokens computed than without it, and the same greedy tokens."""
    rng = random.Random(7)
    shared = [rng.randrange(3, EOS) for _ in range(96)]
    others = [[rng.randrange(3, EOS) for _ in range(100)] for _ in range(2)]
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    results = {}
    for swap in (None, "4MiB"):
        llm = LLM(model=model_dir, swap_space=swap, **{**ENGINE, "num_kv_blocks_override": 40,
                                                       "max_num_batched_tokens": 128})
        try:
            llm.generate([shared + [5]], greedy, use_tqdm=False)
            for p in others:  # each fills most of the pool: the shared blocks are evicted
                llm.generate([p], greedy, use_tqdm=False)
            before = llm.llm_engine.get_stats().prompt_tokens_total
            out = generate(llm, [shared + [6, 7]], [greedy])
            results[swap] = (out, llm.llm_engine.get_stats().prompt_tokens_total - before)
        finally:
            llm.shutdown()
    assert results[None][0] == results["4MiB"][0]
    assert results[None][1] == 98 and results["4MiB"][1] == 2, results


@pytest.mark.parametrize("executor", ["uniproc", "multiproc"])
def test_a_swap_space_that_cannot_be_allocated_fails_at_start_naming_the_flag(model_dir, executor):
    with pytest.raises(Exception, match="--swap-space"):
        LLM(model=model_dir, executor=executor, swap_space="100000GiB", **ENGINE)


def test_engine_core_process_swaps_and_reports_it(model_dir, reference):
    """The engine core in its own process (the server's default layout): same tokens, swap counters
    and Timing's swap count cross the process boundary."""
    prompts, params, expected = reference
    llm = LLM(model=model_dir, engine_core="process", swap_space="4MiB", **ENGINE)
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert [[c.token_ids for c in o.outputs] for o in outs] == expected
        extra = llm.llm_engine.get_stats().extra
        assert extra["swap_outs"] > 0 and extra["num_free_swap_blocks"] == extra["num_swap_blocks"]
        assert sum(o.metrics.num_swaps for o in outs) == extra["swap_outs"]
    finally:
        llm.shutdown()
