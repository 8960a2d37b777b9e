"""The engine core in its own process (MPClient) against the inline one (InprocClient), on a tiny
random Llama with a real tokenizer: the same greedy tokens and text under chunked prefill,
preemption, n > 1 and stop strings; abort mid-flight and id reuse; utility calls; and a killed
core process failing the front end fast."""
from __future__ import annotations

import os
import signal
import time

import pytest

from executors.base import ExecutorError
from llmsvc.engine.llm_engine import LLMEngine
from llmsvc.llm import LLM
from llmsvc.sampling_params import SamplingParams
from tests.server_harness import make_tiny_served_model_dir

# small steps and a small KV pool: prompts are chunked and running requests get preempted
ENGINE_KW = dict(device="cpu", block_size=16, max_num_batched_tokens=24, max_num_seqs=6,
                 num_kv_blocks_override=14, max_model_len=160)
PROMPTS = ["the quick brown fox jumps over the lazy dog " * 2, "hello", "a b c d e f g h i j k l m n o p",
           "x" * 70, "tell me a story", "0123456789"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_served_model_dir(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def inline(model_dir):
    with LLM(model_dir, engine_core="inline", **ENGINE_KW) as llm:
        yield llm


@pytest.fixture(scope="module")
def process(model_dir):
    with LLM(model_dir, engine_core="process", **ENGINE_KW) as llm:
        yield llm


def _summary(outs):
    return [[(c.index, c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outs]


def test_greedy_outputs_equal_inline_with_chunked_prefill_preemption_and_n(inline, process):
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, n=2)
    before = process.llm_engine.get_stats().num_preemptions
    want = inline.generate(PROMPTS, params, use_tqdm=False)
    got = process.generate(PROMPTS, params, use_tqdm=False)
    assert _summary(got) == _summary(want)
    assert all(len(c.token_ids) == 40 for o in got for c in o.outputs)
    assert process.llm_engine.get_stats().num_preemptions > before, "the KV pool was meant to force preemption"
    stats = process.llm_engine.get_stats()
    assert stats.num_running == stats.num_waiting == 0


def test_stop_strings_finish_the_same_way(inline, process):
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    free = inline.generate(PROMPTS, params, use_tqdm=False)
    # a stop string from the middle of each free-running text: the request must end there
    stops = [o.outputs[0].text[8:11] for o in free if len(o.outputs[0].text) > 12]
    assert stops
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop=stops)
    want = inline.generate(PROMPTS, params, use_tqdm=False)
    got = process.generate(PROMPTS, params, use_tqdm=False)
    assert _summary(got) == _summary(want)
    assert any(o.outputs[0].finish_reason == "stop" for o in got)
    # the stop-string finishes went back to the core as aborts: a round trip behind them finds no
    # request holding KV blocks (reset_prefix_cache refuses otherwise)
    assert process.llm_engine.reset_prefix_cache() is True
    assert process.llm_engine.get_stats().num_running == 0


def test_abort_mid_flight_then_reuse_the_id(inline, process):
    engine: LLMEngine = process.llm_engine
    tok = engine.tokenizer
    ids = tok.encode("abort me please")
    engine.add_request("r", ids, SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True))
    seen = 0
    while seen < 3:
        seen += sum(len(c.token_ids) for o in engine.step() for c in o.outputs)
    engine.abort_request("r")
    outs = engine.step()
    assert [o.outputs[0].finish_reason for o in outs if o.request_id == "r"] == ["abort"]
    # the same id at once: outputs the core computed for the old request must not leak in
    engine.add_request("r", ids, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    final = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            final = o
    want = inline.generate([ids], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert final.finished and final.outputs[0].token_ids == want[0].outputs[0].token_ids
    stats = engine.get_stats()
    assert stats.num_running == stats.num_waiting == 0
    assert stats.num_free_kv_blocks == stats.num_kv_blocks  # nothing leaked (cached blocks count as free)


def test_reset_prefix_cache_goes_to_the_core(process):
    engine = process.llm_engine
    process.generate(["warm the prefix cache " * 3], SamplingParams(max_tokens=2), use_tqdm=False)
    assert engine.reset_prefix_cache() is True
    assert engine.get_stats().num_kv_blocks == 14


def _core_pid(engine: LLMEngine) -> int:
    return engine.core_client.proc.pid


def test_core_killed_mid_step_fails_fast(model_dir):
    engine = LLMEngine.from_config(_config(model_dir))
    try:
        engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=250, temperature=0.0, ignore_eos=True))
        engine.step()
        os.kill(_core_pid(engine), signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(ExecutorError, match="engine-core process .* died"):
            for _ in range(1000):  # bounded: a request that finished first fails the test, not hangs it
                engine.step()
        assert time.monotonic() - t0 < 2.0
        with pytest.raises(ExecutorError):
            engine.check_health()
    finally:
        engine.shutdown()
    assert engine.core_client.proc.exitcode == -signal.SIGKILL


def test_core_killed_while_idle_fails_health_check(model_dir):
    engine = LLMEngine.from_config(_config(model_dir))
    try:
        engine.check_health()
        os.kill(_core_pid(engine), signal.SIGKILL)
        engine.core_client.proc.join(5)
        with pytest.raises(ExecutorError, match="died"):
            engine.check_health()
        with pytest.raises(ExecutorError):
            engine.add_request("b", [1, 2], SamplingParams(max_tokens=2))
            engine.step()
    finally:
        engine.shutdown()


def test_a_call_to_a_dead_core_raises_instead_of_blocking_the_send(model_dir):
    # once ZeroMQ has seen the core's end of the command socket go, a plain PUSH send waits for
    # a peer forever: an idle server's periodic utility call (take_kv_events) hung its engine thread
    import threading

    engine = LLMEngine.from_config(_config(model_dir))
    errors: list[BaseException] = []
    caller = threading.Thread(target=lambda: call(), daemon=True)

    def call():
        try:
            engine.take_kv_events(0)
        except BaseException as e:  # noqa: BLE001 - the test inspects it
            errors.append(e)

    try:
        os.kill(_core_pid(engine), signal.SIGKILL)
        engine.core_client.proc.join(5)
        time.sleep(0.5)  # ZeroMQ notices the closed ipc connection
        caller.start()
        caller.join(10)
        assert not caller.is_alive(), "the call to a dead core never returned"
        assert len(errors) == 1 and isinstance(errors[0], ExecutorError), errors
        assert "died" in str(errors[0])
    finally:
        if not caller.is_alive():  # a hung caller holds the client: leave it to the process' exit
            engine.shutdown()


def test_idle_core_reports_a_tp_rank_death_before_it_exits(model_dir):
    # the core sends why it died, then stops its executor (seconds, with a rank gone); the idle
    # front end's health check used to wait for the process to exit
    from dataclasses import replace

    from tests.executor_procs import worker_pids
    cfg = _config(model_dir)
    cfg = cfg.replace(parallel_config=replace(cfg.parallel_config, tensor_parallel_size=2, executor="tp"))
    engine = LLMEngine.from_config(cfg)
    try:
        engine.check_health()
        ranks = worker_pids(_core_pid(engine))
        assert len(ranks) == 2, ranks
        os.kill(ranks[1], signal.SIGKILL)
        deadline = time.monotonic() + 30
        with pytest.raises(ExecutorError) as ei:
            while time.monotonic() < deadline:
                engine.check_health()
                time.sleep(0.05)
        assert "engine core died" in str(ei.value) and "rank 1" in str(ei.value), ei.value
    finally:
        engine.shutdown()


def test_start_up_failure_in_the_core_is_reported(model_dir):
    cfg = _config(model_dir)
    cfg.cache_config.num_kv_blocks_override = 0  # EngineCore refuses to start without KV blocks
    with pytest.raises(ExecutorError, match="engine core failed to start(.|\n)*no memory for KV cache blocks"):
        LLMEngine.from_config(cfg)


def _config(model_dir: str):
    from llmsvc.config import CacheConfig, EngineConfig, ModelConfig

    return EngineConfig(model_config=ModelConfig(model=model_dir), device="cpu", engine_core="process",
                        cache_config=CacheConfig(kv_cache_memory_bytes=1 << 20), log_stats_interval_s=0.0)
