"""Every executor gives uniproc's greedy tokens; worker death is detected fast and cleanly."""
from __future__ import annotations

import os
import random
import signal
import time

import pytest

from executor_driver import greedy_generate
from executors import ExecutorError, create_executor
from llmsvc.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig
from llmsvc.models.resolve import resolve_model_config
from model_utils import make_tiny_model_dir


def engine_config(model_dir, executor="uniproc", tp=1, num_blocks=96, device="cpu",
                  enforce_eager=False, **cache) -> EngineConfig:
    """num_blocks=None: size the KV pool as the worker would (cache: other CacheConfig fields)."""
    mc = resolve_model_config(ModelConfig(model=str(model_dir), enforce_eager=enforce_eager))
    return EngineConfig(model_config=mc,
                        cache_config=CacheConfig(num_kv_blocks_override=num_blocks, **cache),
                        parallel_config=ParallelConfig(executor=executor, tensor_parallel_size=tp),
                        device=device)


def run(config, prompts, max_new=8, chunk=None):
    ex = create_executor(config)
    try:
        n = ex.determine_num_kv_blocks()
        ex.initialize_kv_cache(n)
        return greedy_generate(ex, prompts, max_new, chunk=chunk)
    finally:
        ex.shutdown()


def prompts_for(vocab: int, lens=(5, 17, 33, 1)) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lens]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny"), arch="llama")


@pytest.fixture(scope="module")
def reference(tiny_dir):
    cfg = engine_config(tiny_dir)
    prompts = prompts_for(cfg.model_config.vocab_size)
    return prompts, run(cfg, prompts)


def test_uniproc_chunked_prefill_matches_whole_prefill(tiny_dir, reference):
    prompts, expected = reference
    assert run(engine_config(tiny_dir), prompts, chunk=4) == expected


@pytest.mark.parametrize("executor,tp", [("multiproc", 1), ("tp", 2)])
def test_executor_matches_uniproc(tiny_dir, reference, executor, tp):
    prompts, expected = reference
    assert run(engine_config(tiny_dir, executor, tp), prompts, chunk=7) == expected


def test_tp_with_fewer_kv_heads_than_ranks(tmp_path):
    d = make_tiny_model_dir(tmp_path, arch="qwen2", num_attention_heads=4, num_key_value_heads=1)
    prompts = prompts_for(engine_config(d).model_config.vocab_size, lens=(9, 20))
    assert run(engine_config(d, "tp", 2), prompts) == run(engine_config(d), prompts)


def _children_alive(pids) -> list[int]:
    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        alive.append(pid)
    return alive


@pytest.mark.parametrize("executor,tp,victim", [("multiproc", 1, 0), ("tp", 2, 1)])
def test_sigkill_worker_fails_fast_and_leaves_no_process(tiny_dir, executor, tp, victim):
    ex = create_executor(engine_config(tiny_dir, executor, tp))
    pids = [p.pid for p in ex.procs]
    ex.initialize_kv_cache(ex.determine_num_kv_blocks())
    killed_at = []

    def on_step(step):
        if step == 2:
            os.kill(pids[victim], signal.SIGKILL)
            killed_at.append(time.monotonic())

    try:
        with pytest.raises(ExecutorError, match="died|lost|exit"):
            greedy_generate(ex, prompts_for(64), max_new=50, on_step=on_step)
        assert time.monotonic() - killed_at[0] < 10.0
        with pytest.raises(ExecutorError):
            ex.check_health()
    finally:
        ex.shutdown()
    deadline = time.monotonic() + 10
    while _children_alive(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _children_alive(pids) == []


def test_a_hung_worker_fails_the_call_after_the_time_limit(tiny_dir, monkeypatch):
    # a stopped (or hung) worker used to block the engine forever with health SERVING
    monkeypatch.setenv("LLMSVC_EXECUTE_MODEL_TIMEOUT_S", "1.5")
    ex = create_executor(engine_config(tiny_dir, "multiproc"))
    try:
        assert ex.call_timeout_s == 1.5
        ex.initialize_kv_cache(ex.determine_num_kv_blocks())
        os.kill(ex.procs[0].pid, signal.SIGSTOP)
        with pytest.raises(ExecutorError, match="timed out after 1.5 s waiting for execute_stats .*a worker is hung"):
            ex.execute_stats()
    finally:
        os.kill(ex.procs[0].pid, signal.SIGCONT)
        ex.shutdown()
    monkeypatch.setenv("LLMSVC_EXECUTE_MODEL_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match="LLMSVC_EXECUTE_MODEL_TIMEOUT_S='soon'"):
        create_executor(engine_config(tiny_dir, "multiproc"))


def test_worker_start_failure_is_reported(tmp_path, tiny_dir):
    cfg = engine_config(tiny_dir, "multiproc")
    cfg.model_config.model_dir = str(tmp_path / "missing")
    with pytest.raises(ExecutorError, match="failed to start"):
        create_executor(cfg)


@pytest.mark.e2e
def test_default_model_tp3_matches_uniproc(default_model_dir):
    """SmolLM2-135M has 9 heads and 3 KV heads: tp=3 puts 3 heads and 1 KV head on each rank."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    prompts = [tok.encode(t) for t in ("The capital of France is", "def fibonacci(n):",
                                          "Once upon a time, in a small village,")]
    uni = run(engine_config(default_model_dir, num_blocks=64), prompts, max_new=24)
    tp3 = run(engine_config(default_model_dir, "tp", 3, num_blocks=64), prompts, max_new=24)
    assert tp3 == uni
