"""Async scheduling in the engine core, driven by the FakeExecutor (no model): the same tokens and
finish reasons as synchronous scheduling, step N+1 really submitted before step N's update, no
leaked block, and placeholders never reach the prefix cache."""
from __future__ import annotations

import random

import pytest

from engine_fakes import FakeExecutor, make_config
from llmsvc.core.engine_core import EngineCore
from llmsvc.core.request import Request
from llmsvc.sampling_params import SamplingParams
from llmsvc.wire import PLACEHOLDER_TOKEN_ID
from test_scheduler import random_prompt, reference_tokens, run


def make_core(async_scheduling: bool, num_blocks: int = 1000, **kw) -> tuple[EngineCore, FakeExecutor]:
    cfg = make_config(num_blocks=num_blocks, **kw)
    cfg.scheduler_config.async_scheduling = async_scheduling
    ex = FakeExecutor(cfg, num_blocks=num_blocks)
    return EngineCore(cfg, ex), ex


def mixed_requests(seed: int) -> list[Request]:
    """Shared prefixes (prefix-cache hits), long prompts (chunked prefill), EOS and stop tokens
    that the fake model does emit, max_tokens=1, min_tokens."""
    rng = random.Random(seed)
    prefix = random_prompt(rng, 12, 12)
    out = []
    for i in range(16):
        prompt = (prefix if i % 3 == 0 else []) + random_prompt(rng, 1, 45)
        ref = reference_tokens(prompt, 12)
        kw = {}
        if i % 4 == 1:
            kw["stop_token_ids"] = [ref[rng.randrange(12)]]
        if i % 5 == 2:
            kw["min_tokens"] = 3
        eos = [ref[rng.randrange(1, 12)]] if i % 4 == 2 else []
        out.append(Request(f"r{i}", prompt, SamplingParams(max_tokens=1 if i % 7 == 3 else 12, **kw),
                           eos_token_ids=eos, priority=i % 3, arrival_time=float(i)))
    return out


def outcome(res: dict) -> dict:
    return {rid: (r["tokens"], r["finish"], r["stop_reason"]) for rid, r in res.items()}


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("num_blocks", [1000, 16])
def test_async_matches_sync_with_chunking_prefix_hits_stops_and_preemption(policy, num_blocks):
    results = {}
    for mode in (False, True):
        core, ex = make_core(mode, num_blocks=num_blocks, block_size=4, max_num_batched_tokens=24,
                             max_num_seqs=6, policy=policy)
        for r in mixed_requests(7):
            core.add_request(r)
        results[mode] = (outcome(run(core)), core.stats, ex)
    (sync, sync_stats, _), (asyn, async_stats, ex) = results[False], results[True]
    assert asyn == sync
    assert {f for _, f, _ in sync.values()} >= {"length", "stop"}
    assert ex.num_placeholders > 0  # the worker really got steps scheduled ahead of the tokens
    if num_blocks == 16:
        assert async_stats.num_preemptions > 0 and sync_stats.num_preemptions > 0
    else:
        assert async_stats.prefix_cache_hit_rate == sync_stats.prefix_cache_hit_rate > 0


def test_next_step_is_submitted_before_the_previous_update():
    core, ex = make_core(True)
    core.add_request(Request("a", [1, 2, 3], SamplingParams(max_tokens=6)))
    seen = []  # steps the executor had received when each update ran
    orig = core.scheduler.update_from_output
    core.scheduler.update_from_output = lambda so, out: seen.append(len(ex.steps)) or orig(so, out)
    res = run(core)
    assert res["a"]["tokens"] == reference_tokens([1, 2, 3], 6)
    # update k (1-based) ran while step k + 1 was already submitted, but for the last step
    assert seen[:-1] == [k + 2 for k in range(len(seen) - 1)], seen
    # its max_tokens are reached by the token in flight: no step 7 is scheduled for it
    assert len(ex.steps) == 6 and seen[-1] == 6


def test_work_scheduled_for_a_request_that_stops_meanwhile_is_dropped():
    ref = reference_tokens([1, 2, 3], 6)
    core, ex = make_core(True)
    core.add_request(Request("a", [1, 2, 3], SamplingParams(max_tokens=6), eos_token_ids=[ref[2]]))
    res = run(core)
    assert res["a"]["tokens"] == ref[:3] and res["a"]["finish"] == "stop"
    assert len(ex.steps) == 4  # step 4 ran before update 3 saw the EOS; its token went nowhere


def test_placeholder_blocks_are_never_hashed():
    # block_size 4, prompt 3: the first sampled token completes block 0 while still a placeholder
    core, ex = make_core(True, block_size=4)
    core.add_request(Request("a", [5, 6, 7], SamplingParams(max_tokens=9)))
    for _ in range(3):
        core.step()
        req = core.scheduler.requests["a"]
        assert len(req.block_hashes) * 4 <= req.num_known_tokens
        assert PLACEHOLDER_TOKEN_ID not in req.all_token_ids[:req.num_known_tokens]
    run(core)
    # a second request with the same prompt and output hits the cached blocks and the fake's
    # KV check verifies their content
    b = [5, 6, 7] + reference_tokens([5, 6, 7], 9)
    core.add_request(Request("b", b, SamplingParams(max_tokens=2)))
    res = run(core)
    assert res["b"]["cached"] == 8 and res["b"]["tokens"] == reference_tokens(b, 2)


def test_abort_while_steps_are_in_flight_frees_everything():
    core, ex = make_core(True, num_blocks=40, block_size=4)
    prompts = {f"r{i}": list(range(10 * i, 10 * i + 7)) for i in range(4)}
    for rid, p in prompts.items():
        core.add_request(Request(rid, p, SamplingParams(max_tokens=20)))
    got = {rid: [] for rid in prompts}
    for _ in range(3):
        for o in core.step()[0]:
            got[o.req_id] += o.new_token_ids
    assert core._in_flight is not None
    assert core.abort_requests(["r1", "r2"]) == ["r1", "r2"]
    res = run(core)
    for rid in ("r0", "r3"):
        assert got[rid] + res[rid]["tokens"] == reference_tokens(prompts[rid], 20)
    for rid in ("r1", "r2"):
        assert rid not in res and got[rid] == reference_tokens(prompts[rid], len(got[rid]))
    assert core._in_flight is None


def test_time_limit_and_max_tokens_one():
    core, ex = make_core(True)
    core.add_request(Request("t", [1, 2, 3], SamplingParams(max_tokens=50, time_limit_ms=0)))
    core.add_request(Request("one", [4, 5, 6], SamplingParams(max_tokens=1)))
    res = run(core)
    assert res["t"]["finish"] == "time_limit"
    assert res["one"] == {"tokens": reference_tokens([4, 5, 6], 1), "finish": "length", "cached": 0,
                          "stop_reason": None}


def test_executor_failure_surfaces_from_the_step():
    from executors.base import ExecutorError

    cfg = make_config()
    cfg.scheduler_config.async_scheduling = True
    ex = FakeExecutor(cfg, fail_after=2)
    core = EngineCore(cfg, ex)
    core.add_request(Request("a", [1, 2, 3], SamplingParams(max_tokens=10)))
    with pytest.raises(ExecutorError):
        for _ in range(10):
            core.step()


def test_flag_env_and_llm_keyword(monkeypatch):
    import argparse

    from llmsvc import llm as llm_module
    from llmsvc.bench import cli as bench_cli
    from llmsvc.engine.llm_engine import LLMEngine
    from llmsvc.server import cli

    def serve_config(argv):
        p = argparse.ArgumentParser()
        cli.add_arguments(p)
        return cli.build_config(p.parse_args(argv))

    assert not serve_config([]).scheduler_config.async_scheduling
    assert serve_config(["--async-scheduling"]).scheduler_config.async_scheduling
    monkeypatch.setenv("LLMSVC_ASYNC_SCHEDULING", "1")
    assert serve_config([]).scheduler_config.async_scheduling
    seen = []
    monkeypatch.setattr(LLMEngine, "from_config", classmethod(lambda cls, config: seen.append(config)))
    llm_module.LLM(async_scheduling=True)
    assert seen[0].scheduler_config.async_scheduling
    a = argparse.Namespace(model=None, dtype="bfloat16", executor="auto", engine_core="process",
                           tensor_parallel_size=1, max_num_seqs=None, max_num_batched_tokens=None,
                           kv_cache_memory=None, async_scheduling=True)
    assert "--async-scheduling" in bench_cli._serve_args(a)


@pytest.mark.parametrize("num_blocks", [256, 24])
def test_structured_output_and_prompt_logprobs_fall_back_and_match(num_blocks):
    """Steps that sample under a grammar, or compute prompt positions of a request asking for
    prompt logprobs, are not overlapped; outputs equal synchronous scheduling, also when
    constrained requests are preempted (24 blocks) and beside unconstrained ones."""
    from llmsvc.engine.llm_engine import LLMEngine
    from llmsvc.sampling_params import StructuredOutputsParams as SO
    from tests.server_harness import EOS, TINY_VOCAB, letters, tiny_tokenizer
    from tests.test_structured_engine import SCHEMA, params
    from tests.test_structured_engine import run as run_engine

    tok = tiny_tokenizer()
    reqs = {f"s{i}": (f"prompt {i} " * 3, params(SO(json=SCHEMA))) for i in range(4)}
    # the free requests outlive the constrained ones (26 tokens here) however long their grammars
    # take to compile, so some steps sample without a grammar and are overlapped
    reqs |= {f"f{i}": (f"free {i} " * 4, SamplingParams(temperature=0.0, max_tokens=60)) for i in range(3)}
    reqs["lp"] = ("with prompt logprobs " * 2, SamplingParams(temperature=0.0, max_tokens=8, prompt_logprobs=1))
    got = {}
    for mode in (False, True):
        config = make_config(num_blocks=num_blocks, block_size=4, max_num_seqs=8, max_num_batched_tokens=32)
        config.model_config.vocab_size = TINY_VOCAB
        config.model_config.eos_token_ids = [EOS]
        config.scheduler_config.async_scheduling = mode
        engine = LLMEngine(config, FakeExecutor(config, num_blocks=num_blocks, token_fn=letters), tok)
        try:
            done = run_engine(engine, reqs)
            got[mode] = {rid: (o.outputs[0].token_ids, o.outputs[0].finish_reason,
                               [None if e is None else sorted(e) for e in o.prompt_logprobs or []])
                         for rid, o in done.items()}
            if num_blocks == 24:
                assert engine.core.scheduler.num_preemptions > 0
            if mode:
                assert engine.core.executor.num_placeholders > 0
        finally:
            engine.shutdown()
    assert got[True] == got[False]
    assert all(got[True][f"s{i}"][1] == "stop" for i in range(4))
    assert len(got[True]["lp"][2]) > 30  # the prompt's positions, reported once each


def test_preempted_in_flight_and_admitted_again_drops_the_stale_sample():
    # the priority policy can preempt a request and admit it again in the same schedule, before
    # the output of its step in flight comes; emulated here by preempting between two steps
    prompt = list(range(100, 110))
    core, ex = make_core(True, block_size=4)
    core.add_request(Request("r", prompt, SamplingParams(max_tokens=8)))
    got = [t for o in core.step()[0] for t in o.new_token_ids]
    s = core.scheduler
    r = s.requests["r"]
    assert r.num_output_placeholders == 1  # its second token is in flight
    s.running.remove(r)
    s._preempt(r)
    res = run(core)
    assert got + res["r"]["tokens"] == reference_tokens(prompt, 8)
    assert ex.steps[2].new_req_ids == ["r"]  # admitted again before the stale output came


def test_request_id_reused_while_the_old_ones_step_is_in_flight():
    prompt = list(range(100, 110))
    core, ex = make_core(True, block_size=4)
    core.add_request(Request("x", prompt, SamplingParams(max_tokens=8)))
    core.step()
    assert core._in_flight is not None and core.abort_requests(["x"]) == ["x"]
    core.add_request(Request("x", prompt[:7], SamplingParams(max_tokens=5)))
    res = run(core)
    assert res["x"]["tokens"] == reference_tokens(prompt[:7], 5)
