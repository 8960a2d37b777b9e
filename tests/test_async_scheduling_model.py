"""Async scheduling on a tiny random model: every executor gives synchronous uniproc's tokens,
with chunked prefill, preemption (small KV pool), prefix hits, stop strings and stop tokens,
n > 1 with seeded sampling, max_tokens=1, time limits and an abort while steps are in flight;
every KV block is free at the end."""
from __future__ import annotations

import random

import pytest

from llmsvc import LLM, SamplingParams
from tests.server_harness import EOS, make_tiny_served_model_dir

ENGINE = dict(block_size=4, num_kv_blocks_override=36, max_num_batched_tokens=32, max_num_seqs=8)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_served_model_dir(tmp_path_factory.mktemp("async"))


def workload() -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(3)
    shared = [rng.randrange(3, EOS) for _ in range(12)]
    prompts = [shared + [rng.randrange(3, EOS) for _ in range(n)] for n in (2, 30, 60)]
    prompts += [[rng.randrange(3, EOS) for _ in range(n)] for n in (5, 41, 9)]
    greedy = dict(temperature=0.0, ignore_eos=True)
    params = [SamplingParams(max_tokens=24, **greedy), SamplingParams(max_tokens=1, **greedy),
              SamplingParams(max_tokens=18, **greedy),
              SamplingParams(n=2, temperature=0.9, seed=11, max_tokens=16, ignore_eos=True),
              SamplingParams(max_tokens=20, **greedy), SamplingParams(max_tokens=20, **greedy)]
    return prompts, params


def generate(llm: LLM, prompts, params) -> list:
    outs = llm.generate(prompts, params, use_tqdm=False)
    stats = llm.llm_engine.get_stats()
    assert stats.num_free_kv_blocks == stats.num_kv_blocks, "leaked KV blocks"
    return [[(c.token_ids, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outs]


@pytest.fixture(scope="module")
def reference(model_dir):
    llm = LLM(model=model_dir, **ENGINE)
    try:
        prompts, params = workload()
        first = generate(llm, prompts, params)
        # stop on a token (request 4) and on a string (request 5) that the unstopped outputs hold
        params[4] = SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=[first[4][0][0][6]])
        text5 = llm.get_tokenizer().decode(first[5][0][0])
        params[5] = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, stop=[text5[8:11]])
        out = generate(llm, prompts, params)
        preempted = llm.llm_engine.get_stats().num_preemptions
    finally:
        llm.shutdown()
    assert preempted > 0, "the pool is meant to be small enough to preempt"
    assert out[4][0][1] == "stop" and out[5][0][1] == "stop" and out[1][0][0] and len(out[1][0][0]) == 1
    return prompts, params, out, first


@pytest.mark.parametrize("executor,tp", [("uniproc", 1), ("multiproc", 1), ("tp", 2)])
def test_async_scheduling_matches_sync(model_dir, reference, executor, tp):
    prompts, params, expected, unstopped = reference
    llm = LLM(model=model_dir, executor=executor, tensor_parallel_size=tp, async_scheduling=True, **ENGINE)
    try:
        assert llm.llm_engine.core.async_scheduling
        assert generate(llm, prompts, params) == expected
        assert llm.llm_engine.get_stats().num_preemptions > 0
        if executor == "uniproc":
            _abort_and_time_limit(llm, prompts, unstopped)
    finally:
        llm.shutdown()


def _abort_and_time_limit(llm: LLM, prompts, unstopped) -> None:
    engine = llm.llm_engine
    greedy = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    engine.add_request("keep", prompts[4], greedy)
    engine.add_request("drop", prompts[5], greedy)
    engine.add_request("late", prompts[0], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                                                          time_limit_ms=0))
    finals = {}
    for _ in range(3):
        for o in engine.step():
            finals[o.request_id] = o
    assert engine.core._in_flight is not None  # the abort lands while a step is in flight
    engine.abort_request("drop")
    while engine.has_unfinished_requests():
        for o in engine.step():
            finals[o.request_id] = o
    if "drop" in finals:  # aborted: whatever it reported is the start of its greedy output
        dropped = finals["drop"].outputs[0].token_ids
        assert len(dropped) < 20 and dropped == unstopped[5][0][0][:len(dropped)]
    keep = finals["keep"].outputs[0]
    assert (keep.token_ids, keep.finish_reason) == (unstopped[4][0][0], "length")
    late = finals["late"].outputs[0]
    assert late.finish_reason == "time_limit" and late.token_ids == unstopped[0][0][0][:len(late.token_ids)]
    stats = engine.get_stats()
    assert stats.num_free_kv_blocks == stats.num_kv_blocks, "leaked KV blocks"


def test_grpc_server_with_async_core_process_matches_offline_sync(model_dir, reference):
    """One `llmsvc serve`-like server (engine core in its own process, async scheduling) answers
    concurrent streams with the tokens synchronous offline uniproc gives."""
    check_grpc_async_core_process(model_dir, reference, device="cpu")


def check_grpc_async_core_process(model_dir, reference, device: str) -> None:
    """Four concurrent greedy streams from a server whose engine core runs in its own process
    with async scheduling on `device` give the CPU's synchronous offline tokens; no block held."""
    from concurrent.futures import ThreadPoolExecutor

    from llmsvc.config import EngineConfig
    from llmsvc.engine.llm_engine import LLMEngine
    from llmsvc.v1 import llmsvc_pb2 as pb
    from tests.server_harness import ServerThread

    prompts, _, _, unstopped = reference
    config = EngineConfig.from_options(model=model_dir, engine_core="process", async_scheduling=True,
                                       device=device, log_stats_interval_s=0.0, **ENGINE)
    greedy = [0, 2, 4, 5]  # the requests with plain greedy params in the unstopped run
    with ServerThread(lambda: LLMEngine.from_config(config)) as srv:
        def call(i):
            req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompts[i]), stream=True,
                                     sampling=pb.SamplingParams(temperature=0.0),
                                     stopping=pb.StoppingCriteria(max_tokens=len(unstopped[i][0][0]),
                                                                  ignore_eos=True))
            return [t for m in srv.stub.Generate(req) for t in m.token_ids]

        with ThreadPoolExecutor(len(greedy)) as pool:
            got = list(pool.map(call, greedy))
        info = srv.stub.GetServerInfo(pb.GetServerInfoRequest())
    assert got == [unstopped[i][0][0] for i in greedy]
    assert info.num_free_kv_blocks == info.num_kv_blocks
