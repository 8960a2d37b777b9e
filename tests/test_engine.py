"""LLMEngine with the FakeExecutor: validation, stop strings, aborts, n > 1, streaming, stats."""
from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from engine_fakes import VOCAB, FakeExecutor, make_config, smollm2_tokenizer
from executors.base import ExecutorError
from llmsvc.engine_request import EngineRequest
from llmsvc.core.errors import DuplicateRequestError, InvalidRequestError, PromptTooLongError
from llmsvc.engine.llm_engine import LLMEngine
from llmsvc.engine.stats import StatsLogger
from llmsvc.outputs import EngineStats
from llmsvc.sampling_params import RequestOutputKind, SamplingParams

DELTA = RequestOutputKind.DELTA


@pytest.fixture(scope="module")
def tok():
    return smollm2_tokenizer()


def scripted(tok, text: str, prompt_len: int):
    """token_fn emitting the ids of `text` (then repeating them), for prompts of prompt_len tokens."""
    ids = tok.encode(text)
    return lambda toks: ids[(len(toks) - prompt_len) % len(ids)]


def make_engine(tok, token_fn=None, num_blocks=64, **kw):
    cfg = make_config(num_blocks=num_blocks, **kw)
    if token_fn is not None:  # scripted real-tokenizer ids
        cfg.model_config.vocab_size = len(tok)
    ex = FakeExecutor(cfg, num_blocks=num_blocks, **({"token_fn": token_fn} if token_fn else {}))
    return LLMEngine(cfg, ex, tok), ex


def run_all(engine, max_steps=5000):
    outs = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for ro in engine.step():
            outs.setdefault(ro.request_id, []).append(ro)
    assert not engine.has_unfinished_requests()
    stats = engine.get_stats()
    assert stats.num_free_kv_blocks == stats.num_kv_blocks and stats.num_running == stats.num_waiting == 0
    return outs


def test_validation_errors(tok):
    engine, _ = make_engine(tok, max_model_len=64)
    ok = SamplingParams(max_tokens=4)
    engine.add_request("a", [1, 2, 3], ok)
    with pytest.raises(DuplicateRequestError):
        engine.add_request("a", [1, 2, 3], ok)
    cases = [
        ([], ok, "prompt"),
        ([1, VOCAB], ok, "prompt_token_ids[1]"),
        ([1, -1], ok, "prompt_token_ids[1]"),
        ([1] * 60, SamplingParams(max_tokens=5), "max_tokens"),
        ([1] * 60, SamplingParams(max_tokens=None, min_tokens=5), "prompt"),  # 60 + 4 fits in 64; 60 + 5 does not
        ([1], SamplingParams(stop=[str(i) for i in range(65)]), "stop"),
        ([1], SamplingParams(n=17), "n"),
        ([1], SamplingParams(stop_token_ids=[VOCAB + 5]), "stop_token_ids[0]"),
    ]
    for prompt, params, field in cases:
        with pytest.raises(InvalidRequestError) as e:
            engine.add_request("x", prompt, params)
        assert e.value.field == field and isinstance(e.value, ValueError), (field, e.value)
    bad = SamplingParams()
    bad.temperature = -1.0  # verify() runs again at admission
    with pytest.raises(InvalidRequestError, match="temperature"):
        engine.add_request("x", [1], bad)
    with pytest.raises(PromptTooLongError) as e:
        engine.add_request("x", [1] * 64, SamplingParams(max_tokens=None))
    assert e.value.prompt_tokens == 64 and e.value.max_model_len == 64
    assert "x" not in engine.output_processor
    run_all(engine)
    engine.add_request("a", [1, 2, 3], ok)  # the id is free again once finished
    run_all(engine)


def test_max_logprobs_bounds_logprobs_and_prompt_logprobs(tok):
    cfg = make_config(num_blocks=64)
    cfg.max_logprobs = 3  # the engine's limits are read once, when it is built
    engine = LLMEngine(cfg, FakeExecutor(cfg, num_blocks=64), tok)
    engine.add_request("ok", [1, 2], SamplingParams(max_tokens=1, logprobs=3, prompt_logprobs=3))
    for field in ("logprobs", "prompt_logprobs"):
        with pytest.raises(InvalidRequestError, match=r"\[0, 3\]") as ei:
            engine.add_request(f"big-{field}", [1, 2], SamplingParams(max_tokens=1, **{field: 4}))
        assert ei.value.field == field
    assert list(run_all(engine)) == ["ok"]


def test_offline_engine_has_no_waiting_cap(tok):
    # max_waiting_requests is the serving front end's admission cap (AsyncEngine, tested there):
    # an offline generate queues every prompt it is given
    engine, _ = make_engine(tok, max_num_seqs=1)
    engine.config.scheduler_config.max_waiting_requests = 2
    for i in range(5):
        engine.add_request(f"r{i}", [1, i], SamplingParams(max_tokens=2))
    assert sorted(run_all(engine)) == [f"r{i}" for i in range(5)]


def test_partly_added_n_request_is_rolled_back(tok, monkeypatch):
    # the core refuses child 1 of an n=2 request after taking child 0: child 0 must leave the core
    # again, or it runs for nobody and its id is taken for ever
    engine, _ = make_engine(tok)
    engine.add_request("a", [1], SamplingParams(max_tokens=2))
    core_add = engine.core.add_request

    def refuse_child_1(request):
        if request.request_id == "1_pair":
            raise RuntimeError("refused")
        core_add(request)
    monkeypatch.setattr(engine.core, "add_request", refuse_child_1)
    with pytest.raises(RuntimeError, match="refused"):
        engine.add_request("pair", [1, 2], SamplingParams(n=2, max_tokens=2))
    monkeypatch.setattr(engine.core, "add_request", core_add)
    assert "pair" not in engine.output_processor
    assert sorted(engine.core.scheduler.requests) == ["a"]
    engine.add_request("b", [1], SamplingParams(max_tokens=2))
    assert sorted(run_all(engine)) == ["a", "b"]
    engine.add_request("pair", [1, 2], SamplingParams(n=2, max_tokens=2))  # refused if child 0 stayed
    assert sorted(run_all(engine)) == ["pair"]


def test_stop_string_finishes_request_in_core(tok):
    prompt = tok.encode("Q: name an animal. A:")
    engine, ex = make_engine(tok, token_fn=scripted(tok, " The brown fox jumps high", len(prompt)))
    engine.add_request("s", prompt, SamplingParams(max_tokens=50, stop=["fox"], output_kind=DELTA))
    outs = run_all(engine)["s"]
    assert "".join(o.outputs[0].text for o in outs) == " The brown "
    assert outs[-1].outputs[0].finish_reason == "stop" and outs[-1].outputs[0].stop_reason == "fox"
    assert len(outs[-1].outputs[0].token_ids) < 50
    engine.add_request("t", prompt, SamplingParams(max_tokens=1))  # tells the worker on the next step
    run_all(engine)
    assert "s" not in ex.reqs


def test_deltas_concatenate_to_final_text(tok):
    text = " Café ☕ 你好 🎉 done."
    prompt = tok.encode("Say something nice about the weather today, please:")
    assert len(prompt) >= 8
    engine, _ = make_engine(tok, token_fn=scripted(tok, text, len(prompt)))
    n_ids = len(tok.encode(text))
    engine.add_request("d", prompt, SamplingParams(max_tokens=n_ids, output_kind=DELTA))
    engine.add_request("f", prompt, SamplingParams(max_tokens=n_ids, output_kind=RequestOutputKind.FINAL_ONLY))
    outs = run_all(engine)
    assert "".join(o.outputs[0].text for o in outs["d"]) == text == outs["f"][0].outputs[0].text
    assert len(outs["f"]) == 1 and outs["f"][0].num_cached_tokens > 0  # "f" reused "d"'s prompt blocks
    m = outs["f"][0].metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time <= m.finished_time


def test_abort_produces_final_output_and_frees_blocks(tok):
    engine, ex = make_engine(tok)
    engine.add_request("a", list(range(1, 40)), SamplingParams(max_tokens=100, output_kind=DELTA))
    engine.add_request("w", list(range(1, 20)), SamplingParams(max_tokens=3))
    engine.step()
    engine.abort_request(["a", "nope"])
    engine.abort_request("a")  # twice: harmless
    outs = engine.step()
    final = [o for o in outs if o.request_id == "a"]
    assert len(final) == 1 and final[0].finished and final[0].outputs[0].finish_reason == "abort"
    run_all(engine)


def test_n_parallel_samples_share_prompt_blocks(tok):
    engine, ex = make_engine(tok, block_size=4)
    prompt = list(range(100, 121))  # 5 full blocks
    engine.add_request("p", prompt, SamplingParams(n=3, max_tokens=4, output_kind=RequestOutputKind.FINAL_ONLY))
    (ro,) = run_all(engine)["p"]
    assert [o.index for o in ro.outputs] == [0, 1, 2]
    assert all(len(o.token_ids) == 4 and o.finish_reason == "length" for o in ro.outputs)
    first = ex.steps[0]
    assert first.num_scheduled == {"0_p": 21, "1_p": 1, "2_p": 1}  # children 1, 2 hit the shared prefix
    assert engine.get_stats().prefix_cache_hit_rate == pytest.approx(40 / 63)


def test_executor_failure_raises(tok):
    cfg = make_config()
    engine = LLMEngine(cfg, FakeExecutor(cfg, fail_after=1), tok)
    engine.add_request("a", [1, 2], SamplingParams(max_tokens=5))
    engine.step()
    with pytest.raises(ExecutorError):
        engine.step()
    engine.shutdown()
    assert engine.core.executor.shut_down


def test_stats_logger_line(caplog):
    logger = StatsLogger(interval_s=5.0)
    s = EngineStats(num_running=3, num_waiting=2, kv_cache_usage=0.25, prefix_cache_hit_rate=0.5,
                    num_preemptions=1, prompt_tokens_total=100, generation_tokens_total=10)
    assert logger.maybe_log(s, now=0.0) is None
    s.prompt_tokens_total, s.generation_tokens_total = 600, 60
    assert logger.maybe_log(s, now=1.0) is None
    with caplog.at_level(logging.INFO, logger="llmsvc.engine"):
        line = logger.maybe_log(s, now=10.0)
    assert line == ("Avg prompt throughput: 50.0 tokens/s, Avg generation throughput: 5.0 tokens/s, "
                    "Running: 3 reqs, Waiting: 2 reqs, KV cache usage: 25.0%, Prefix cache hit rate: 50.0%, "
                    "Preemptions: 1")
    assert line in caplog.text


def test_stats_logger_idle_lines_after_the_first_are_debug(caplog):
    logger = StatsLogger(interval_s=5.0)
    s = EngineStats(prompt_tokens_total=100, generation_tokens_total=10)
    logger.maybe_log(s, now=0.0)
    s.generation_tokens_total = 60  # the tail of a workload, then nothing
    with caplog.at_level(logging.DEBUG, logger="llmsvc.engine"):
        for t in (5.0, 10.0, 15.0):
            logger.maybe_log(s, now=t)
    levels = [(r.levelname, "generation throughput: 10.0" in r.message) for r in caplog.records]
    assert levels == [("INFO", True), ("INFO", False), ("DEBUG", False)]


def test_idle_engine_thread_logs_the_throughput_line(tok):
    # the tail of a workload used to wait for the next request's step to be logged
    import asyncio

    from llmsvc.engine.async_engine import AsyncEngine
    cfg = make_config().replace(log_stats_interval_s=0.3)
    engine = LLMEngine(cfg, FakeExecutor(cfg), tok)
    lines = []
    engine.stats_logger.log = type("L", (), {"info": lines.append, "debug": lines.append})()

    async def main():
        ae = AsyncEngine(engine)
        ae.health_check_interval_s = 0.05
        await ae.start()
        async for _ in ae.generate(EngineRequest("a", [1, 2, 3], SamplingParams(max_tokens=4))):
            pass
        n = len(lines)
        await asyncio.sleep(1.0)  # no request: the idle tick logs
        assert len(lines) > n and any("Avg generation throughput" in x for x in lines[n:])
        await ae.shutdown()

    asyncio.run(main())


def test_engine_and_package_import_without_torch():
    code = ("import sys, llmsvc; from llmsvc import SamplingParams; import llmsvc.engine.llm_engine, "
            "llmsvc.core.engine_core, llmsvc.core.scheduler, llmsvc.engine.output_processor; "
            "bad = [m for m in ('torch', 'transformers') if m in sys.modules]; "
            "assert not bad, bad; assert 'llmsvc.llm' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=__file__.rsplit("/tests/", 1)[0])
