"""End-to-end engine tests on the real default model (SmolLM2-135M-Instruct GGUF), greedy."""
from __future__ import annotations

import pytest

from llmsvc import LLM, SamplingParams

TEXT = (
    "The history of computing is a story of layers. At the bottom sit transistors, switching billions "
    "of times a second; above them logic gates, then arithmetic units, caches, cores and memory buses. "
    "Each layer hides the one below it behind a simpler promise, and every generation of engineers "
    "builds on the promises of the last. Operating systems turned raw hardware into processes and files; "
    "compilers turned human-readable code into machine instructions; networks turned isolated machines "
    "into a single planet-sized computer. Language models are the newest layer: they turn text into "
    "predictions about more text, and serving them efficiently is a problem of scheduling, memory and "
    "batching, much like the operating systems of fifty years ago. "
)
GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    engine = LLM(max_num_seqs=32, max_num_batched_tokens=512)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def text_ids(llm):
    ids = llm.get_tokenizer().encode(TEXT * 6)
    assert len(ids) > 650
    return ids


def alone(llm, prompts, params):
    return [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]


def test_32_concurrent_requests_equal_each_alone(llm, text_ids):
    lengths = [3 + (i * 37) % 200 for i in range(32)]
    prompts = [text_ids[i * 7: i * 7 + n] for i, n in enumerate(lengths)]
    params = SamplingParams(max_tokens=8, **GREEDY)
    batched = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert batched == alone(llm, prompts, params)
    stats = llm.llm_engine.get_stats()
    assert stats.num_free_kv_blocks == stats.num_kv_blocks


def test_shared_256_token_prefix_reports_cached_tokens_and_same_output(llm, text_ids):
    prefix = text_ids[:256]
    b = prefix + text_ids[400:420]
    params = SamplingParams(max_tokens=16, **GREEDY)
    llm.llm_engine.reset_prefix_cache()
    (without,) = llm.generate([b], params, use_tqdm=False)
    assert without.num_cached_tokens == 0
    assert llm.llm_engine.reset_prefix_cache()
    (a_out,) = llm.generate([prefix + text_ids[300:330]], params, use_tqdm=False)
    (with_cache,) = llm.generate([b], params, use_tqdm=False)
    assert with_cache.num_cached_tokens == 256
    assert with_cache.outputs[0].token_ids == without.outputs[0].token_ids


def test_tiny_kv_pool_preempts_and_gives_same_tokens(llm, text_ids):
    prompts = [text_ids[i * 11: i * 11 + 40 + 5 * i] for i in range(8)]
    params = SamplingParams(max_tokens=32, **GREEDY)
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    tiny = LLM(max_num_seqs=8, max_num_batched_tokens=256, num_kv_blocks_override=16)
    try:
        got = [o.outputs[0].token_ids for o in tiny.generate(prompts, params, use_tqdm=False)]
        stats = tiny.llm_engine.get_stats()
        assert stats.num_preemptions > 0
        assert stats.num_free_kv_blocks == stats.num_kv_blocks == 16
    finally:
        tiny.shutdown()
    assert got == expected
