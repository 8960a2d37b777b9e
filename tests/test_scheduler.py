"""Scheduler + EngineCore driven by the FakeExecutor (no model)."""
from __future__ import annotations

import random
import time

import pytest

from engine_fakes import VOCAB, FakeExecutor, make_config, next_token
from llmsvc.core.engine_core import EngineCore
from llmsvc.core.errors import PromptTooLongError
from llmsvc.core.request import Request
from llmsvc.sampling_params import SamplingParams


def reference_tokens(prompt: list[int], n: int) -> list[int]:
    toks = list(prompt)
    for _ in range(n):
        toks.append(next_token(toks))
    return toks[len(prompt):]


def run(core: EngineCore, max_steps: int = 10_000) -> dict[str, dict]:
    res: dict[str, dict] = {}
    for _ in range(max_steps):
        if not core.has_unfinished():
            break
        outs, _ = core.step()
        core.kv_cache_manager.check_invariants()
        for o in outs:
            r = res.setdefault(o.req_id, {"tokens": [], "finish": None, "cached": 0, "stop_reason": None})
            assert r["finish"] is None, "output after finish"
            r["tokens"] += o.new_token_ids
            r["finish"], r["stop_reason"], r["cached"] = o.finish_reason, o.stop_reason, o.num_cached_tokens
    assert not core.has_unfinished()
    assert core.kv_cache_manager.num_free_blocks == core.kv_cache_manager.num_blocks, "leaked blocks"
    return res


def req(rid: str, prompt: list[int], max_tokens: int | None = 8, priority: int = 0, arrival: float | None = None,
        eos: list[int] = (), **kw) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, **kw), priority=priority,
                   arrival_time=arrival, eos_token_ids=eos)


def random_prompt(rng: random.Random, lo: int = 1, hi: int = 40) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(rng.randint(lo, hi))]


def make_core(**kw) -> tuple[EngineCore, FakeExecutor]:
    cfg = make_config(**kw)
    ex = FakeExecutor(cfg, num_blocks=10_000)
    return EngineCore(cfg, ex), ex


def test_budget_and_max_num_seqs_never_exceeded_and_tokens_match_reference():
    rng = random.Random(0)
    core, ex = make_core(num_blocks=200, max_num_batched_tokens=24, max_num_seqs=5)
    assert ex.initialized == 200
    prompts = {f"r{i}": random_prompt(rng, 1, 60) for i in range(20)}
    for rid, p in prompts.items():
        core.add_request(req(rid, p, max_tokens=rng.randint(1, 12)))
    res = run(core)
    for rec in ex.steps:
        assert rec.total <= 24
        assert len(rec.num_scheduled) <= 5
    assert any(rec.total == 24 for rec in ex.steps)  # the budget is actually used
    for rid, p in prompts.items():
        assert res[rid]["finish"] == "length"
        assert res[rid]["tokens"] == reference_tokens(p, len(res[rid]["tokens"]))


def test_chunked_prefill_splits_and_mixes_with_decodes():
    core, ex = make_core(max_num_batched_tokens=16, block_size=4)
    core.add_request(req("short", [1, 2, 3], max_tokens=10))
    first, _ = core.step()
    long_prompt = list(range(100, 150))  # 50 tokens
    core.add_request(req("long", long_prompt, max_tokens=3))
    res = run(core)
    chunks = [s.num_scheduled.get("long") for s in ex.steps if "long" in s.num_scheduled]
    # decode of "short" takes 1 token per step, the prompt gets the rest of the budget
    assert chunks[:4] == [15, 15, 15, 5], chunks
    assert sum(chunks[:4]) == 50 and chunks[4:] == [1, 1]
    mixed = [s for s in ex.steps if "long" in s.num_scheduled and "short" in s.num_scheduled]
    assert mixed and all(s.num_scheduled["short"] == 1 for s in mixed)
    assert res["long"]["tokens"] == reference_tokens(long_prompt, 3)
    assert first[0].new_token_ids + res["short"]["tokens"] == reference_tokens([1, 2, 3], 10)


def test_no_chunking_when_disabled():
    core, ex = make_core(max_num_batched_tokens=16, chunked=False)
    core.add_request(req("a", list(range(10)), max_tokens=2))
    core.add_request(req("b", list(range(20, 32)), max_tokens=2))  # 10 + 12 > 16: waits a step
    run(core)
    assert ex.steps[0].num_scheduled == {"a": 10}
    assert ex.steps[1].num_scheduled == {"a": 1, "b": 12}


def test_prompt_that_fits_a_later_step_whole_is_not_split_to_fill_this_one():
    # budget 16, block 4: "a" (10) is admitted whole; "b" (12) does not fit the 6 left, but a step
    # with only this step's running work takes it whole, so it waits instead of being split
    core, ex = make_core(max_num_batched_tokens=16, block_size=4)
    core.add_request(req("a", list(range(10)), max_tokens=3))
    core.add_request(req("b", list(range(20, 32)), max_tokens=3))
    core.add_request(req("long", list(range(40, 80)), max_tokens=2))  # 40 > 16: chunked anyway
    res = run(core)
    assert ex.steps[0].num_scheduled == {"a": 10}
    assert ex.steps[1].num_scheduled == {"a": 1, "b": 12, "long": 3}  # the head fitted; "long" fills
    assert ex.steps[2].num_scheduled == {"a": 1, "b": 1, "long": 14}
    assert res["b"]["tokens"] == reference_tokens(list(range(20, 32)), 3)
    assert res["long"]["tokens"] == reference_tokens(list(range(40, 80)), 2)


def test_head_prompt_is_split_when_running_work_leaves_it_no_whole_step():
    # 3 running decodes leave 13 of 16: a 14-token prompt could never run whole beside them,
    # so it is chunked rather than left waiting
    core, ex = make_core(max_num_batched_tokens=16, block_size=4)
    for i in range(3):
        core.add_request(req(f"d{i}", [i + 1], max_tokens=6))
    core.step()
    core.add_request(req("p", list(range(50, 64)), max_tokens=2))
    res = run(core)
    assert ex.steps[1].num_scheduled == {"d0": 1, "d1": 1, "d2": 1, "p": 13}
    assert res["p"]["tokens"] == reference_tokens(list(range(50, 64)), 2)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_preemption_and_resume_give_same_tokens(policy):
    rng = random.Random(1)
    prompts = {f"r{i}": random_prompt(rng, 5, 30) for i in range(12)}
    results = []
    for num_blocks in (1000, 14):
        cfg = make_config(num_blocks=num_blocks, block_size=4, max_num_batched_tokens=32, max_num_seqs=8,
                          policy=policy)
        ex = FakeExecutor(cfg, num_blocks=num_blocks)
        core = EngineCore(cfg, ex)
        for i, (rid, p) in enumerate(prompts.items()):
            core.add_request(req(rid, p, max_tokens=20, priority=i % 3))
        results.append((run(core), core.stats.num_preemptions, ex))
    (big, big_pre, _), (tiny, tiny_pre, ex) = results
    assert big_pre == 0 and tiny_pre > 0
    for rid in prompts:
        assert tiny[rid]["tokens"] == big[rid]["tokens"] == reference_tokens(prompts[rid], 20)
    # a resumed request is sent again in full, with its output so far
    resent = [rid for s in ex.steps for rid in s.new_req_ids]
    assert len(resent) > len(prompts)


def test_preempted_request_is_sent_to_workers_as_finished_then_new():
    cfg = make_config(num_blocks=6, block_size=4, max_num_batched_tokens=64)
    ex = FakeExecutor(cfg, num_blocks=6)
    core = EngineCore(cfg, ex)
    core.add_request(req("old", list(range(8)), max_tokens=12, arrival=1.0))
    core.add_request(req("new", list(range(50, 58)), max_tokens=12, arrival=2.0))
    sos = []
    orig = core.scheduler.schedule
    core.scheduler.schedule = lambda: sos.append(orig()) or sos[-1]
    res = run(core)
    first_pre = next(i for i, so in enumerate(sos) if "new" in so.finished_req_ids)
    assert "old" not in sos[first_pre].finished_req_ids  # the latest arrival is the victim
    later_new = [so for so in sos[first_pre + 1:] if any(n.req_id == "new" for n in so.scheduled_new_reqs)]
    assert later_new and later_new[0].scheduled_new_reqs[0].output_token_ids  # resumes with its outputs
    assert res["new"]["tokens"] == reference_tokens(list(range(50, 58)), 12)


def test_priority_policy_orders_admission():
    core, ex = make_core(policy="priority", max_num_seqs=1)
    core.add_request(req("low", [1, 2], max_tokens=2, priority=5, arrival=1.0))
    core.add_request(req("high", [3, 4], max_tokens=2, priority=-1, arrival=2.0))
    core.add_request(req("mid", [5, 6], max_tokens=2, priority=0, arrival=3.0))
    core.add_request(req("mid_early", [7, 8], max_tokens=2, priority=0, arrival=0.5))
    run(core)
    order = [rid for s in ex.steps for rid in s.new_req_ids]
    assert order == ["high", "mid_early", "mid", "low"]


def test_fcfs_ignores_priority():
    core, ex = make_core(max_num_seqs=1)
    core.add_request(req("a", [1], max_tokens=1, priority=9))
    core.add_request(req("b", [2], max_tokens=1, priority=-9))
    run(core)
    assert [rid for s in ex.steps for rid in s.new_req_ids] == ["a", "b"]


def test_prefix_cache_hit_counts_and_computes_only_the_rest():
    core, ex = make_core(block_size=4, max_num_batched_tokens=256)
    prefix = list(range(200, 222))  # 22 tokens: 5 full blocks
    core.add_request(req("a", prefix + [1, 2, 3], max_tokens=4))
    res_a = run(core)
    core.add_request(req("b", prefix + [7, 8], max_tokens=4))
    res_b = run(core)
    assert res_a["a"]["cached"] == 0
    assert res_b["b"]["cached"] == 20
    step_b = next(s for s in ex.steps if "b" in s.new_req_ids)
    assert step_b.new_num_computed["b"] == 20 and step_b.num_scheduled["b"] == 4
    assert res_b["b"]["tokens"] == reference_tokens(prefix + [7, 8], 4)
    kv = core.kv_cache_manager
    assert kv.prefix_hits == 20 and kv.prefix_queries == 25 + 24
    assert core.stats.prefix_cache_hit_rate == pytest.approx(20 / 49)


def test_full_prompt_hit_still_computes_one_token():
    core, ex = make_core(block_size=4)
    prompt = list(range(300, 316))  # exactly 4 blocks
    core.add_request(req("a", prompt, max_tokens=1))
    run(core)
    core.add_request(req("b", prompt, max_tokens=3))
    res = run(core)
    step_b = next(s for s in ex.steps if "b" in s.new_req_ids)
    assert res["b"]["cached"] == 12 and step_b.num_scheduled["b"] == 4
    assert res["b"]["tokens"] == reference_tokens(prompt, 3)


def test_same_step_requests_share_prefix_blocks():
    core, ex = make_core(block_size=4, max_num_batched_tokens=256)
    prefix = list(range(400, 416))
    core.add_request(req("a", prefix + [1], max_tokens=2))
    core.add_request(req("b", prefix + [2], max_tokens=2))
    res = run(core)
    assert res["b"]["cached"] == 16
    assert ex.steps[0].num_scheduled == {"a": 17, "b": 1}


def test_prefix_caching_disabled():
    core, ex = make_core(block_size=4, enable_prefix_caching=False)
    prompt = list(range(20))
    core.add_request(req("a", prompt, max_tokens=1))
    run(core)
    core.add_request(req("b", prompt, max_tokens=1))
    res = run(core)
    assert res["b"]["cached"] == 0
    kv = core.kv_cache_manager  # nothing was looked up, so nothing is counted (the metrics' queries)
    assert (kv.prefix_queries, kv.prefix_hits) == (0, 0)


def test_stop_conditions_without_text():
    core, _ = make_core()
    p = [5, 6, 7]
    ref = reference_tokens(p, 30)
    core.add_request(req("eos", p, max_tokens=30, eos=[ref[3]]))
    core.add_request(req("ignore", p, max_tokens=6, eos=[ref[3]], ignore_eos=True))
    core.add_request(req("min", p, max_tokens=30, eos=[ref[3]], min_tokens=5))
    core.add_request(req("stopid", p, max_tokens=30, stop_token_ids=[ref[2]]))
    core.add_request(req("ctx", p, max_tokens=None))
    res = run(core)
    # a 3-token prompt fills no 4-token block, so nothing is served from the prefix cache
    assert res["eos"] == {"tokens": ref[:4], "finish": "stop", "cached": 0, "stop_reason": ref[3]}
    assert res["ignore"]["tokens"] == ref[:6] and res["ignore"]["finish"] == "length"
    # min_tokens=5: the EOS at output index 3 is ignored; the first one from index 4 on ends it
    k = next((i for i in range(4, 30) if ref[i] == ref[3]), None)
    want = {"tokens": ref[:30], "finish": "length", "cached": 0, "stop_reason": None} if k is None else \
        {"tokens": ref[:k + 1], "finish": "stop", "cached": 0, "stop_reason": ref[3]}
    assert res["min"] == want
    assert res["stopid"]["tokens"] == ref[:3] and res["stopid"]["stop_reason"] == ref[2]
    assert res["ctx"]["finish"] == "context"
    # a request never outgrows the context nor the KV pool (64 blocks of 4 < max_model_len 512)
    assert len(p) + len(res["ctx"]["tokens"]) == core.max_len == 256


def test_time_limit_finishes_gracefully():
    core, _ = make_core()
    core.add_request(req("t", [1, 2, 3], max_tokens=None, time_limit_ms=30))
    core.add_request(req("other", [4, 5], max_tokens=3))
    outs, _ = core.step()
    time.sleep(0.05)
    res = run(core)
    got = [o for o in outs if o.req_id == "t"][0].new_token_ids + res["t"]["tokens"]
    assert res["t"]["finish"] == "time_limit" and len(got) >= 1
    assert res["other"]["finish"] == "length"


def test_abort_frees_blocks_and_tells_workers():
    core, ex = make_core()
    core.add_request(req("a", list(range(30)), max_tokens=50))
    core.add_request(req("b", list(range(40, 70)), max_tokens=5))
    core.step()
    assert core.abort_requests(["a", "missing"]) == ["a"]
    assert core.abort_requests(["a"]) == []
    run(core)
    assert "a" not in ex.reqs
    core.kv_cache_manager.check_invariants()


def test_prompt_that_can_never_fit_the_pool_is_rejected():
    cfg = make_config(num_blocks=4, block_size=4)
    core = EngineCore(cfg, FakeExecutor(cfg, num_blocks=100))
    assert core.kv_cache_manager.num_blocks == 4  # capped by num_kv_blocks_override
    with pytest.raises(PromptTooLongError) as e:
        core.add_request(req("x", list(range(16))))
    assert isinstance(e.value, ValueError) and "KV cache" in str(e.value)
    core.add_request(req("ok", list(range(15)), max_tokens=None))
    res = run(core)
    assert res["ok"]["finish"] == "context" and res["ok"]["tokens"] == reference_tokens(list(range(15)), 1)


def test_priority_preemption_victim_is_lowest_priority():
    cfg = make_config(num_blocks=6, block_size=4, max_num_batched_tokens=64, policy="priority")
    ex = FakeExecutor(cfg, num_blocks=6)
    core = EngineCore(cfg, ex)
    core.add_request(req("unimportant", list(range(8)), max_tokens=12, priority=3, arrival=1.0))
    core.add_request(req("urgent", list(range(50, 58)), max_tokens=12, priority=-3, arrival=2.0))
    preempted = []
    orig = core.scheduler._preempt
    core.scheduler._preempt = lambda r: preempted.append(r.request_id) or orig(r)
    res = run(core)
    assert preempted and set(preempted) == {"unimportant"}
    assert res["unimportant"]["tokens"] == reference_tokens(list(range(8)), 12)


@pytest.mark.parametrize("low_prompt", [5, 6, 7])
def test_priority_preemption_never_takes_the_higher_ranked_request(low_prompt):
    # "low" runs first (scheduled earlier in each step); "high" outranks it. When a step runs out
    # of blocks, the victim is "low", even though it was already scheduled in that step (it used
    # to be "high", the only one not scheduled yet, and then "low" as well to readmit "high")
    cfg = make_config(num_blocks=12, block_size=4, max_num_seqs=2, max_num_batched_tokens=64, policy="priority")
    core = EngineCore(cfg, FakeExecutor(cfg, num_blocks=12))
    preempted = []
    orig = core.scheduler._preempt
    core.scheduler._preempt = lambda r: preempted.append(r.request_id) or orig(r)
    low, high = list(range(1, 1 + low_prompt)), list(range(50, 62))
    core.add_request(req("low", low, max_tokens=24, priority=5, arrival=1.0))
    (first,), _ = core.step()
    core.add_request(req("high", high, max_tokens=24, priority=0, arrival=2.0))
    res = run(core)
    assert preempted and set(preempted) == {"low"}, preempted
    assert res["high"]["tokens"] == reference_tokens(high, 24)
    assert first.new_token_ids + res["low"]["tokens"] == reference_tokens(low, 24)


def test_a_resumed_request_is_no_prefix_cache_lookup():
    # two unrelated prompts and a preemption: the hit rate stays that of the prompts (0), the
    # resumed request's recompute (its own blocks found again) is not a client's cache hit
    cfg = make_config(num_blocks=8, block_size=4, max_num_batched_tokens=64)
    core = EngineCore(cfg, FakeExecutor(cfg, num_blocks=8))
    preempted = []
    orig = core.scheduler._preempt
    core.scheduler._preempt = lambda r: preempted.append(r.request_id) or orig(r)
    core.add_request(req("a", list(range(1, 10)), max_tokens=10))
    core.add_request(req("b", list(range(40, 49)), max_tokens=10))
    run(core)
    kv = core.kv_cache_manager
    assert preempted and (kv.prefix_queries, kv.prefix_hits) == (18, 0)


def test_context_finish_at_max_model_len():
    core, _ = make_core(num_blocks=1000, max_model_len=40)
    core.add_request(req("c", list(range(30)), max_tokens=None))
    res = run(core)
    assert res["c"]["finish"] == "context" and len(res["c"]["tokens"]) == 10


def test_block_content_reused_at_another_position_is_recomputed():
    # the FakeExecutor checks every attended slot holds (position, token): a prefix-cache hit on a
    # block computed at another position (hash without its parent) fails there or in the tokens
    core, _ = make_core(block_size=4)
    P, Q, Y = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]
    core.add_request(req("a", P + Q + Y + [13], max_tokens=2))
    run(core)
    for rid, prompt in (("b", P + Y + [13]), ("c", Q + Y + Y + [13]), ("d", P + Q + Y + [14])):
        core.add_request(req(rid, prompt, max_tokens=4))
        res = run(core)
        assert res[rid]["tokens"] == reference_tokens(prompt, 4)
        assert res[rid]["cached"] == {"b": 4, "c": 0, "d": 12}[rid]


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_a_prompt_that_cannot_be_held_whole_waits_instead_of_thrashing(policy):
    # 20 blocks of 4 tokens. "a" grows to 70 tokens (18 blocks); "b" needs 11 blocks for its 42
    # tokens. Admitted on its first chunk's blocks alone, "b" computed chunks that a's growth took
    # back by preemption, step after step (with nothing cached to resume from), until "a" ended.
    cfg = make_config(num_blocks=20, block_size=4, max_num_batched_tokens=16, policy=policy,
                      enable_prefix_caching=False)
    core = EngineCore(cfg, FakeExecutor(cfg, num_blocks=20))
    pa, pb = list(range(40)), list(range(100, 142))
    core.add_request(req("a", pa, max_tokens=30, arrival=1.0))
    core.step()
    core.add_request(req("b", pb, max_tokens=4, arrival=2.0))
    res = run(core)
    assert core.stats.num_preemptions == 0
    assert res["a"]["tokens"] == reference_tokens(pa, 30) and res["b"]["tokens"] == reference_tokens(pb, 4)


def test_a_prompt_that_fits_beside_the_running_ones_is_admitted_at_once():
    cfg = make_config(num_blocks=40, block_size=4, max_num_batched_tokens=16, enable_prefix_caching=False)
    core = EngineCore(cfg, FakeExecutor(cfg, num_blocks=40))
    core.add_request(req("a", list(range(40)), max_tokens=30, arrival=1.0))
    for _ in range(3):  # a's prompt in chunks of 16, 16, 8
        core.step()
    core.add_request(req("b", list(range(100, 142)), max_tokens=4, arrival=2.0))
    core.step()
    assert {r.request_id for r in core.scheduler.running} == {"a", "b"}  # chunked prefill beside a's decode
    assert core.scheduler.requests["b"].num_computed_tokens == 15
