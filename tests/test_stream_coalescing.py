"""Coalescing with real text: AsyncEngine over the real LLMEngine (output processor, incremental
detokenizer, stop strings) on a byte-level tokenizer whose model emits multi-byte UTF-8 one byte
per token. A slow reader gets the engine's deltas folded into fewer outputs; the deltas of a slow
and of a fast reader both concatenate to the full text (never a split character), the token ids
to every id generated, and each stream ends with exactly one finished output."""
from __future__ import annotations

import asyncio
import time

from llmsvc.engine.async_engine import AsyncEngine
from llmsvc.engine.llm_engine import LLMEngine
from llmsvc.engine_request import EngineRequest
from llmsvc.outputs import STOP
from llmsvc.sampling_params import SamplingParams
from tests.engine_fakes import FakeExecutor, make_config
from tests.server_harness import EOS, TINY_VOCAB, tiny_tokenizer

TOK = tiny_tokenizer()
PROMPT = TOK.encode("ab")
TEXT = "héllo wörld ✓ 日本語 " * 4
STOP_STR = "✓ 日"
BYTES = TEXT.encode("utf-8")  # tiny_tokenizer: token id b is the raw byte b


def emit_text(tokens: list[int]) -> int:
    return BYTES[(len(tokens) - len(PROMPT)) % len(BYTES)]


def _engine() -> LLMEngine:
    config = make_config(num_blocks=256, block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    config.model_config.vocab_size = TINY_VOCAB
    config.model_config.eos_token_ids = [EOS]
    ex = FakeExecutor(config, num_blocks=256, token_fn=emit_text)
    inner = ex.execute_model

    def paced(so):  # a model that takes time: a reader that keeps up sees every step
        time.sleep(0.002)
        return inner(so)
    ex.execute_model = paced
    return LLMEngine(config, ex, TOK)


async def _read(ae: AsyncEngine, rid: str, params: SamplingParams, slow: bool):
    agen = ae.generate(EngineRequest(rid, PROMPT, params))
    outs = [await agen.__anext__()]
    if slow:  # do not read until the engine has finished the request: every later delta waits
        while rid in ae._streams:
            await asyncio.sleep(0.005)
    outs += [o async for o in agen]
    return outs, ae._streams.get(rid)


def _run(params: SamplingParams, slow: bool):
    async def main():
        ae = AsyncEngine(_engine())
        await ae.start()
        try:
            return await _read(ae, "r", params, slow)
        finally:
            await ae.shutdown()
    outs, _ = asyncio.run(asyncio.wait_for(main(), 60))
    return outs


def _joined(outs):
    comps = [c for o in outs for c in o.outputs]
    return "".join(c.text for c in comps), [t for c in comps for t in c.token_ids], comps


def test_slow_reader_gets_coalesced_deltas_that_concatenate_to_the_full_text():
    params = SamplingParams(temperature=0.0, max_tokens=len(BYTES), ignore_eos=True)
    fast, slow = _run(params, slow=False), _run(params, slow=True)
    want_ids = list(BYTES)
    for outs in (fast, slow):
        text, ids, comps = _joined(outs)
        assert text == TEXT and ids == want_ids
        assert all("\ufffd" not in c.text for c in comps)
        assert [o.finished for o in outs].count(True) == 1 and outs[-1].finished
    assert len(slow) <= 2 < len(fast)  # everything after the first output came as one message
    # a multi-byte character spans several tokens: some fast deltas carry ids but no text yet
    assert any(c.token_ids and not c.text for c in _joined(fast)[2])


def test_coalesced_deltas_respect_the_stop_string_holdback():
    params = SamplingParams(temperature=0.0, max_tokens=len(BYTES), ignore_eos=True, stop=[STOP_STR])
    end = TEXT.index(STOP_STR)
    want_ids = list(TEXT[:end + len(STOP_STR)].encode("utf-8"))  # ids are not held back
    fast, slow = _run(params, slow=False), _run(params, slow=True)
    for outs in (fast, slow):
        text, ids, comps = _joined(outs)
        assert text == TEXT[:end] and ids == want_ids
        assert comps[-1].finish_reason == STOP and comps[-1].stop_reason == STOP_STR
        # no delta ever showed a prefix of the stop string that the final text does not keep
        assert all(TEXT[:end].startswith(t) for t in _prefixes(comps))
    assert len(slow) <= 2 < len(fast)


def _prefixes(comps):
    acc = ""
    for c in comps:
        acc += c.text
        yield acc


def test_stream_interval_flag_env_and_llm_keyword(monkeypatch):
    import argparse

    import pytest

    from llmsvc import llm as llm_module
    from llmsvc.bench import cli as bench_cli
    from llmsvc.server import cli

    def serve_config(argv):
        p = argparse.ArgumentParser()
        cli.add_arguments(p)
        return cli.build_config(p.parse_args(argv))

    assert serve_config([]).scheduler_config.stream_interval == 1
    assert serve_config(["--stream-interval", "8"]).scheduler_config.stream_interval == 8
    with pytest.raises(SystemExit):
        serve_config(["--stream-interval", "0"])
    monkeypatch.setenv("LLMSVC_STREAM_INTERVAL", "4")
    assert serve_config([]).scheduler_config.stream_interval == 4
    seen = []
    monkeypatch.setattr(LLMEngine, "from_config", classmethod(lambda cls, config: seen.append(config)))
    llm_module.LLM(stream_interval=3)
    assert seen[0].scheduler_config.stream_interval == 3
    a = argparse.Namespace(model=None, dtype="bfloat16", executor="auto", engine_core="process",
                           tensor_parallel_size=1, max_num_seqs=None, max_num_batched_tokens=None,
                           kv_cache_memory=None, async_scheduling=False, stream_interval=8)
    args = bench_cli._serve_args(a)
    assert args[args.index("--stream-interval") + 1] == "8"
