"""Swap-preemption and the host tier, scheduler + EngineCore driven by the FakeExecutor (no model).

The fake moves each slot's (position, token) on every copy and checks, each step, that every
position a request attends to holds its own token: a swapped request that resumed from the wrong
blocks, a copy run out of order, or a host-tier hit with stale contents fails there."""
from __future__ import annotations

import random

import pytest

from engine_fakes import VOCAB, FakeExecutor, make_config
from llmsvc.core.engine_core import EngineCore
from llmsvc.core.request import Request, RequestStatus
from llmsvc.outputs import ABORT
from llmsvc.sampling_params import SamplingParams
from test_scheduler import reference_tokens


def make_core(num_blocks=24, num_host_blocks=64, mode="auto", async_scheduling=False, **kw):
    cfg = make_config(num_blocks=num_blocks, **kw)
    cfg.cache_config.swap_space_bytes = 1 if num_host_blocks else 0
    cfg.scheduler_config.preemption_mode = mode
    cfg.scheduler_config.async_scheduling = async_scheduling
    ex = FakeExecutor(cfg, num_blocks=num_blocks, num_host_blocks=num_host_blocks)
    return EngineCore(cfg, ex), ex


def run(core: EngineCore, max_steps: int = 10_000) -> dict[str, list[int]]:
    res: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not core.has_unfinished():
            break
        outs, _ = core.step()
        core.kv_cache_manager.check_invariants()
        if core.scheduler.swap is not None:
            core.scheduler.swap.check_invariants()
        for o in outs:
            res.setdefault(o.req_id, []).extend(o.new_token_ids)
    assert not core.has_unfinished()
    kv = core.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks, "leaked device blocks"
    swap = core.scheduler.swap
    if swap is not None:
        assert not swap.req_to_blocks and swap.num_free_blocks == swap.num_blocks, "leaked host blocks"
    return res


def workload(n=8, seed=0, max_tokens=24):
    rng = random.Random(seed)
    return {f"r{i}": [rng.randrange(VOCAB) for _ in range(rng.randint(10, 30))] for i in range(n)}, max_tokens


def add_all(core, prompts, max_tokens, **params):
    for rid, p in prompts.items():
        core.add_request(Request(rid, p, SamplingParams(max_tokens=max_tokens, **params)))


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_swap_preemption_resumes_exactly(async_scheduling, policy):
    prompts, mt = workload()
    core, ex = make_core(async_scheduling=async_scheduling, policy=policy)
    add_all(core, prompts, mt)
    out = run(core)
    for rid, p in prompts.items():
        assert out[rid] == reference_tokens(p, mt), rid
    s = core.scheduler
    assert s.swap.num_swap_outs > 0 and s.swap.num_swap_ins == s.swap.num_swap_outs
    assert s.num_preemptions == s.swap.num_swap_outs, "every preemption was a swap: the space had room"
    # resumed requests never recompute their prompt: prompt tokens computed once each
    assert s.prompt_tokens_total <= sum(len(p) for p in prompts.values()) + s.swap.num_swap_ins


def test_swap_computes_fewer_tokens_than_recompute():
    prompts, mt = workload()
    totals = {}
    for mode in ("recompute", "swap"):
        core, ex = make_core(mode=mode, enable_prefix_caching=False,
                             num_host_blocks=64 if mode == "swap" else 0)
        add_all(core, prompts, mt)
        out = run(core)
        assert all(out[r] == reference_tokens(p, mt) for r, p in prompts.items())
        assert core.scheduler.num_preemptions > 0
        totals[mode] = sum(s.total for s in ex.steps)
    assert totals["swap"] < totals["recompute"], totals


def test_full_swap_space_falls_back_to_recompute():
    prompts, mt = workload()
    core, ex = make_core(num_host_blocks=3)  # too small for most victims
    add_all(core, prompts, mt)
    out = run(core)
    assert all(out[r] == reference_tokens(p, mt) for r, p in prompts.items())
    s = core.scheduler
    assert s.num_preemptions > s.swap.num_swap_outs  # some recomputed


def test_recompute_mode_never_swaps_but_keeps_the_host_tier():
    prompts, mt = workload()
    core, ex = make_core(mode="recompute")
    add_all(core, prompts, mt)
    run(core)
    assert core.scheduler.num_preemptions > 0 and core.scheduler.swap.num_swap_outs == 0


def test_diff_fields_swap_out_then_in_as_a_new_request():
    """Two requests that cannot both grow: the newer is swapped out (its blocks in
    blocks_to_swap_out, its id in finished_req_ids), later swapped in (blocks_to_swap_in, sent in
    full with its num_computed_tokens) and never recomputes its prompt."""
    core, ex = make_core(num_blocks=6, num_host_blocks=8, enable_prefix_caching=False, max_num_batched_tokens=32)
    a, b = [1] * 9, [2] * 9  # 3 blocks each at 4 tokens per block; they fill the pool with 3 more tokens
    core.add_request(Request("a", a, SamplingParams(max_tokens=8)))
    core.add_request(Request("b", b, SamplingParams(max_tokens=8)))
    sos = []
    orig = ex._execute
    ex._execute = lambda so: (sos.append(so), orig(so))[1]
    out = run(core)
    assert out["a"] == reference_tokens(a, 8) and out["b"] == reference_tokens(b, 8)
    out_step = next(i for i, so in enumerate(sos) if so.blocks_to_swap_out)
    so = sos[out_step]
    assert "b" in so.finished_req_ids and "b" not in so.num_scheduled_tokens
    assert len(so.blocks_to_swap_out) == 3  # b's 9 prompt + 2 outputs computed -> 11 tokens, 3 blocks
    in_step = next(i for i, so in enumerate(sos) if so.blocks_to_swap_in)
    so = sos[in_step]
    assert in_step > out_step
    new = {n.req_id: n for n in so.scheduled_new_reqs}
    assert new["b"].num_computed_tokens > len(b) - 1 and new["b"].output_token_ids
    assert [d for _, d in so.blocks_to_swap_in] == new["b"].block_ids[:len(so.blocks_to_swap_in)]
    assert so.num_scheduled_tokens["b"] == 1  # the last known token: it samples the next one
    assert core.scheduler.swap.num_swap_outs == 1 and ex.num_blocks_copied == 6


def _swapped_core():
    core, ex = make_core(num_blocks=6, num_host_blocks=8, enable_prefix_caching=False)
    core.add_request(Request("a", [1] * 9, SamplingParams(max_tokens=12)))
    core.add_request(Request("b", [2] * 9, SamplingParams(max_tokens=12, time_limit_ms=60_000)))
    for _ in range(50):
        core.step()
        if core.scheduler.swapped:
            return core, ex
    raise AssertionError("b was never swapped out")


def test_abort_of_a_swapped_request_frees_its_host_blocks():
    core, ex = _swapped_core()
    swap = core.scheduler.swap
    assert swap.num_held_blocks > 0
    assert core.abort_requests(["b"]) == ["b"]
    assert not core.scheduler.swapped and swap.num_held_blocks == 0
    run(core)  # a finishes; run checks both pools are whole


def test_deadline_of_a_swapped_request_frees_its_host_blocks():
    core, ex = _swapped_core()
    req = core.scheduler.requests["b"]
    assert req.status == RequestStatus.SWAPPED
    req.deadline = 0.0  # past
    outs, _ = core.step()
    assert any(o.req_id == "b" and o.finish_reason == "time_limit" for o in outs)
    run(core)


def test_abort_storm_on_swapped_requests_leaks_nothing():
    rng = random.Random(5)
    for async_scheduling in (False, True):
        core, ex = make_core(num_blocks=20, num_host_blocks=24, async_scheduling=async_scheduling)
        prompts, mt = workload(n=16, seed=2, max_tokens=30)
        add_all(core, prompts, mt)
        for _ in range(400):
            if not core.has_unfinished():
                break
            core.step()
            swapped = [r.request_id for r in core.scheduler.swapped]
            if swapped and rng.random() < 0.5:
                core.abort_requests([rng.choice(swapped)], ABORT)
            core.scheduler.swap.check_invariants()
        run(core)


def test_host_tier_hit_avoids_recompute():
    """A shared prefix evicted from a small KV cache comes back from the host tier: the returning
    request computes only its new tokens, and its tokens are those of a fresh run."""
    rng = random.Random(1)
    shared = [rng.randrange(VOCAB) for _ in range(24)]  # 6 full blocks
    computed = {}
    for host in (0, 32):
        core, ex = make_core(num_blocks=12, num_host_blocks=host, max_num_batched_tokens=64)
        core.add_request(Request("first", shared + [5], SamplingParams(max_tokens=2)))
        run(core)
        for i in range(3):  # unrelated prompts evict the shared blocks from the device
            core.add_request(Request(f"x{i}", [rng.randrange(VOCAB) for _ in range(40)], SamplingParams(max_tokens=2)))
            run(core)
        before = core.scheduler.prompt_tokens_total
        core.add_request(Request("back", shared + [7, 8], SamplingParams(max_tokens=4)))
        out = run(core)
        assert out["back"] == reference_tokens(shared + [7, 8], 4)
        computed[host] = core.scheduler.prompt_tokens_total - before
        if host:
            assert core.scheduler.swap.num_host_hits == 6
    assert computed[0] == 26 and computed[32] == 2, computed


def test_reset_prefix_cache_forgets_the_host_tier():
    core, ex = make_core(num_blocks=12, num_host_blocks=32)
    core.add_request(Request("a", list(range(24)) + [5], SamplingParams(max_tokens=2)))
    run(core)
    core.add_request(Request("x", list(range(100, 140)), SamplingParams(max_tokens=2)))
    run(core)
    swap = core.scheduler.swap
    assert swap.pool.cached
    assert core.kv_cache_manager.pool.reset_prefix_cache()
    assert not swap.pool.cached


def test_swap_with_speculative_decoding_and_async_are_exact():
    from llmsvc.config import SpeculativeConfig

    prompts, mt = workload(seed=3)
    prompts = {r: p + p[:6] for r, p in prompts.items()}  # repeats give the lookup drafts
    cfg = make_config(num_blocks=24)
    cfg.cache_config.swap_space_bytes = 1
    cfg.speculative_config = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=2, prompt_lookup_max=3)
    ex = FakeExecutor(cfg, num_blocks=24, num_host_blocks=64)
    core = EngineCore(cfg, ex)
    add_all(core, prompts, mt)
    out = run(core)
    assert all(out[r] == reference_tokens(p, mt) for r, p in prompts.items())
    assert core.scheduler.swap.num_swap_outs > 0


def test_preemption_unregisters_blocks_registered_for_uncomputed_work():
    """A victim taken back out of the step that was to fill a block must not leave that block in
    the prefix cache (a later hit, or the host tier's copy, would read K/V never written)."""
    from llmsvc.core.kv_cache_manager import KVCacheManager

    kv = KVCacheManager(num_blocks=8, block_size=4)
    r = Request("v", list(range(7)), SamplingParams(max_tokens=4))
    r.append_output_token_ids(99)  # 8 tokens: the step computing position 7 fills block 1
    r.num_computed_tokens = 0
    assert kv.allocate_slots(r, 7) is not None  # prompt: block 0 registered (full), block 1 not
    r.num_computed_tokens = 7
    assert kv.allocate_slots(r, 1) is not None  # this step would fill block 1: registered now
    assert len(kv.pool.cached) == 2
    kv.forget_uncomputed(r)  # ... but the step is taken back (num_computed_tokens stays 7)
    assert list(kv.pool.cached.values()) == [kv.get_block_ids("v")[0]]
    kv.free(r)
    kv.check_invariants()


def test_swap_in_shares_blocks_still_in_the_device_prefix_cache():
    """The victim's leading blocks that no one evicted while it was swapped out come back as
    prefix-cache hits: only the others are copied in, and the tokens are the same."""
    core, ex = make_core(num_blocks=6, num_host_blocks=8, max_num_batched_tokens=32)
    a, b = [1] * 9, [2] * 9
    core.add_request(Request("a", a, SamplingParams(max_tokens=8)))
    core.add_request(Request("b", b, SamplingParams(max_tokens=8)))
    out = run(core)
    assert out["a"] == reference_tokens(a, 8) and out["b"] == reference_tokens(b, 8)
    swap = core.scheduler.swap
    assert swap.num_swap_ins == swap.num_swap_outs == 1
    assert swap.num_blocks_swapped_in < 3, "b's first block was still cached: it needs no copy"


@pytest.mark.parametrize("policy, order", [
    # A (priority 10) is swapped out by B (5), B by C (0); D (5) arrives last. Swapped requests
    # resume by (priority, arrival) under priority, so B goes before D and A last; in swap-out
    # order A came back first and ran ahead of both. FCFS: arrival order, A first.
    ("priority", ["C", "B", "D", "A"]),
    ("fcfs", ["A", "B", "C", "D"]),
])
def test_swapped_requests_resume_in_their_rank_order(policy, order):
    core, _ = make_core(num_blocks=64, policy=policy, max_num_seqs=1)
    finished = []

    def add(rid, priority, max_tokens, t):
        core.add_request(Request(rid, [5, 6, 7, 8, 9], SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                                 priority=priority, arrival_time=t))

    def steps(n):
        for _ in range(n):
            outs, _ = core.step()
            finished.extend(o.req_id for o in outs if o.finish_reason is not None)
    add("A", 10, 12, 1.0)
    steps(3)
    add("B", 5, 6, 2.0)
    steps(3)
    add("C", 0, 6, 3.0)
    steps(2)
    add("D", 5, 6, 4.0)
    steps(200)
    assert not core.has_unfinished()
    assert finished == order
    if policy == "priority":
        assert core.scheduler.num_preemptions == 2 and core.scheduler.swap.num_free_blocks == core.scheduler.swap.num_blocks
