"""Offline LLM front end, on the FakeExecutor (the real model is covered by test_engine_e2e.py)."""
from __future__ import annotations

import itertools
import re

import pytest

from engine_fakes import FakeExecutor, smollm2_tokenizer
from llmsvc.engine.llm_engine import LLMEngine
from llmsvc.llm import LLM, parse_memory
from llmsvc.sampling_params import RequestOutputKind, SamplingParams


@pytest.fixture
def fake_llm(monkeypatch):
    tok = smollm2_tokenizer()
    seen = {}

    def from_config(cls, config):
        config.model_config.max_model_len = config.model_config.max_model_len or 2048
        config.model_config.vocab_size = len(tok)
        config.model_config.eos_token_ids = [2]
        config.model_config.generation_defaults = seen.get("defaults", {"temperature": 0.5, "top_p": 0.9})
        seen["config"] = config
        return cls(config, FakeExecutor(config, num_blocks=256, token_fn=lambda t: 300 + len(t) % 50), tok)

    monkeypatch.setattr(LLMEngine, "from_config", classmethod(from_config))
    return seen


def test_generate_keeps_input_order_and_forwards_config(fake_llm):
    llm = LLM(max_num_seqs=3, max_num_batched_tokens=64, kv_cache_memory="64MiB", block_size=8,
              policy="priority", enable_prefix_caching=False)
    cfg = fake_llm["config"]
    assert cfg.scheduler_config.max_num_seqs == 3 and cfg.scheduler_config.policy == "priority"
    assert cfg.cache_config.block_size == 8 and cfg.cache_config.kv_cache_memory_bytes == 64 << 20
    assert not cfg.cache_config.enable_prefix_caching
    tok = llm.get_tokenizer()
    prompts = ["Hello there", [1, 2, 3, 4], "A much longer prompt " * 10, "x"]
    params = [SamplingParams(max_tokens=k, output_kind=RequestOutputKind.DELTA) for k in (5, 1, 7, 3)]
    outs = llm.generate(prompts, params, use_tqdm=True)
    assert [len(o.outputs[0].token_ids) for o in outs] == [5, 1, 7, 3]
    assert outs[0].prompt == "Hello there" and outs[0].prompt_token_ids == tok.encode("Hello there")
    assert outs[1].prompt is None and outs[1].prompt_token_ids == [1, 2, 3, 4]
    for o in outs:  # FINAL_ONLY: the full output once, whatever kind was asked
        assert o.finished and o.outputs[0].text == tok.decode(o.outputs[0].token_ids)
    single = llm.generate("Hello there", SamplingParams(max_tokens=5))
    assert len(single) == 1 and single[0].outputs[0].token_ids == outs[0].outputs[0].token_ids
    llm.shutdown()


def test_default_params_use_generation_config_and_n(fake_llm):
    llm = LLM()
    d = llm.get_default_sampling_params()
    assert d.temperature == 0.5 and d.top_p == 0.9 and d.max_tokens == 16
    (out,) = llm.generate([[5, 6, 7]], SamplingParams(n=2, max_tokens=2), use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1]
    llm.shutdown()
    # every sampling default generation_config gives, max_new_tokens as max_tokens (vLLM's)
    fake_llm["defaults"] = {"presence_penalty": 0.5, "frequency_penalty": 0.25, "max_tokens": 5}
    llm = LLM()
    d = llm.get_default_sampling_params()
    assert (d.presence_penalty, d.frequency_penalty, d.max_tokens, d.temperature) == (0.5, 0.25, 5, 1.0)
    (out,) = llm.generate([[5, 6, 7]], use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 5 and out.outputs[0].finish_reason == "length"
    (out,) = llm.generate([[5] * 2045], use_tqdm=False)  # no room for the default: to the context
    assert len(out.outputs[0].token_ids) == 3 and out.outputs[0].finish_reason == "length"
    llm.shutdown()
    fake_llm["defaults"] = {"max_tokens": 5000}  # past max_model_len (2048)
    llm = LLM()
    (out,) = llm.generate([[5, 6, 7]], use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 2045


def test_chat_applies_template(fake_llm):
    llm = LLM()
    (out,) = llm.chat([{"role": "user", "content": "Hi!"}], SamplingParams(max_tokens=2))
    prompt = llm.get_tokenizer().decode(out.prompt_token_ids)
    assert "<|im_start|>user" in prompt and prompt.rstrip().endswith("assistant")


def test_bad_arguments(fake_llm):
    with pytest.raises(TypeError, match="no_such_option"):
        LLM(no_such_option=1)
    llm = LLM(max_model_len=32)
    with pytest.raises(ValueError):
        llm.generate(["ok", "x" * 200], SamplingParams(max_tokens=2))
    assert not llm.llm_engine.has_unfinished_requests()  # the accepted one was aborted
    assert llm.llm_engine.get_stats().num_free_kv_blocks == 256
    assert parse_memory("1.5GiB") == 3 << 29 and parse_memory(1024) == 1024
    with pytest.raises(ValueError):
        parse_memory("lots")


def test_wrong_argument_types_say_what_was_wrong(fake_llm):
    llm = LLM()
    sp = SamplingParams(max_tokens=2)
    for call, says in ((lambda: llm.generate(5, sp), "prompts must be"),
                       (lambda: llm.generate([None], sp), "a prompt must be"),
                       (lambda: llm.generate("hi", {"temperature": 0}), "sampling_params must be"),
                       (lambda: llm.generate("hi", sp, priority="x"), "priority must be")):
        with pytest.raises(TypeError, match=says):
            call()
    tup, lst = llm.generate([(504, 3575, 282), [504, 3575, 282]], sp, use_tqdm=False)  # a tuple is token ids too
    assert tup.prompt_token_ids == lst.prompt_token_ids == [504, 3575, 282] and tup.outputs[0].token_ids
    assert not llm.llm_engine.has_unfinished_requests()


def test_chat_refuses_what_the_grpc_doors_refuse(fake_llm):
    llm = LLM()
    sp = SamplingParams(max_tokens=2)
    for kw, field in ((dict(messages=[{"role": "wizard", "content": "hi"}]), "messages[0].role"),
                      (dict(messages=[]), "messages"),
                      (dict(messages=[{"role": "user", "content": "hi"}], chat_template_kwargs={"messages": []}),
                       "chat_template_kwargs")):
        with pytest.raises(ValueError, match=rf"^{re.escape(field)}: "):
            llm.chat(sampling_params=sp, use_tqdm=False, **kw)
    (out,) = llm.chat([{"role": "user"}], sp, use_tqdm=False)  # no content: "", as a gRPC message's default
    assert "<|im_start|>user" in llm.get_tokenizer().decode(out.prompt_token_ids)


def test_an_llm_shut_down_says_so(fake_llm):
    with LLM() as llm:
        llm.generate("hi", SamplingParams(max_tokens=1), use_tqdm=False)
    for call in (lambda: llm.generate("hi", SamplingParams(max_tokens=1)),
                 lambda: llm.chat([{"role": "user", "content": "hi"}]), llm.reset_prefix_cache):
        with pytest.raises(RuntimeError, match="has been shut down"):
            call()
    llm.shutdown()  # again: nothing happens


def test_vllm_prompt_dicts(fake_llm):
    """vLLM's TextPrompt / TokensPrompt dicts, alone or in a list, as its users pass them."""
    llm = LLM()
    tok = llm.get_tokenizer()
    p = SamplingParams(max_tokens=3)
    by_dict = llm.generate([{"prompt_token_ids": [5, 6, 7]}, {"prompt": "Hello there"}], p, use_tqdm=False)
    by_plain = llm.generate([[5, 6, 7], "Hello there"], p, use_tqdm=False)
    assert [o.prompt_token_ids for o in by_dict] == [[5, 6, 7], tok.encode("Hello there")]
    assert [o.prompt for o in by_dict] == [None, "Hello there"]
    assert [o.outputs[0].token_ids for o in by_dict] == [o.outputs[0].token_ids for o in by_plain]
    (single,) = llm.generate({"prompt_token_ids": (9, 10)}, p, use_tqdm=False)
    assert single.prompt_token_ids == [9, 10]
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate([{"text": "no such key"}], p)
    with pytest.raises(TypeError, match="ints"):
        llm.generate([{"prompt_token_ids": "not ids"}], p)
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.llm_engine.get_stats().num_free_kv_blocks == 256


def test_vllm_argument_forms(fake_llm):
    """What scripts written for vLLM's LLM pass: one priority for all, a tqdm-like class,
    OpenAI content parts in chat; chat outputs carry the rendered prompt text."""
    llm = LLM()
    p = SamplingParams(max_tokens=2)
    assert len(llm.generate(["a", "b"], p, priority=1, use_tqdm=False)) == 2  # was len() of an int
    made = []

    class Bar:
        def __init__(self, **kw):
            made.append(kw["total"])

        def update(self, n):
            made.append(n)

        def set_postfix_str(self, *a, **kw):
            pass

        def close(self):
            made.append("closed")
    llm.generate(["a", "b"], p, use_tqdm=Bar)
    assert made == [2, 1, 1, "closed"]
    plain = llm.chat([{"role": "user", "content": "Hi!\nThere"}], p, use_tqdm=False)[0]
    parts = llm.chat([{"role": "user", "content": [{"type": "text", "text": "Hi!"},
                                                   {"type": "text", "text": "There"}]}], p, use_tqdm=False)[0]
    assert parts.prompt_token_ids == plain.prompt_token_ids
    assert parts.prompt == llm.get_tokenizer().decode(parts.prompt_token_ids) and "<|im_start|>user" in parts.prompt
    with pytest.raises(ValueError, match="text parts"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], p)


def test_reaching_max_model_len_finishes_length_as_in_vllm(fake_llm):
    llm = LLM(max_model_len=32)
    (out,) = llm.generate([[5] * 28], SamplingParams(max_tokens=None, ignore_eos=True), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 4 and out.outputs[0].finish_reason == "length"


def test_sampling_params_read_numbers_as_vllm_does(fake_llm):
    import numpy as np
    assert SamplingParams(logprobs=True).logprobs == 1 and SamplingParams(prompt_logprobs=True).prompt_logprobs == 1
    assert SamplingParams(seed=-1).seed is None
    assert SamplingParams(logit_bias={"5": 2.0}).logit_bias == {5: 2.0}  # JSON's keys
    assert SamplingParams(stop_token_ids=[np.int64(7)], top_k=np.int32(3)).stop_token_ids == [7]
    assert type(SamplingParams(temperature=np.float32(0.5)).temperature) is float
    for bad in (dict(top_k=2.5), dict(n="2"), dict(max_tokens=True), dict(temperature="hot")):
        with pytest.raises(ValueError, match=next(iter(bad))):  # used to fail inside the sampler, batch and all
            SamplingParams(**bad)
    # logprobs are bounded by the engine's max_logprobs, not by a constant at construction
    llm = LLM(max_logprobs=30)
    (out,) = llm.generate([[5, 6]], SamplingParams(max_tokens=1, logprobs=25), use_tqdm=False)
    assert out.outputs[0].logprobs is not None
    with pytest.raises(ValueError, match=r"logprobs.*\[0, 30\]"):
        llm.generate([[5, 6]], SamplingParams(max_tokens=1, logprobs=31), use_tqdm=False)


def test_vllm_engine_accessors(fake_llm):
    llm = LLM(max_model_len=64)
    assert llm.llm_engine.model_config.max_model_len == 64
    assert llm.llm_engine.get_tokenizer() is llm.get_tokenizer()
    def cached():
        return llm.generate([[5, 6, 7] * 8], SamplingParams(max_tokens=2), use_tqdm=False)[0].num_cached_tokens
    cached()
    assert cached() > 0
    assert llm.reset_prefix_cache() is True
    assert cached() == 0


def test_min_tokens_masks_the_tokenizers_eos_that_ends_generation(tmp_path):
    # config.json names 5, the tokenizer's EOS is <|im_end|> (2): both end generation, so both
    # are masked until min_tokens (the worker's mask once held config.json's ids only, and the
    # tokenizer's EOS came out as an ordinary token inside min_tokens)
    from model_utils import make_tiny_model_dir
    tok = smollm2_tokenizer()
    d = make_tiny_model_dir(tmp_path, eos_token_id=5)
    tok.save_pretrained(d)
    llm = LLM(model=d, max_num_seqs=2, max_num_batched_tokens=64, kv_cache_memory="16MiB", device="cpu")
    try:
        assert llm.llm_engine.eos_token_ids == [5, tok.eos_token_id]
        for eos in (5, tok.eos_token_id):
            p = SamplingParams(temperature=0.0, min_tokens=4, max_tokens=8, logit_bias={eos: 100.0})
            (out,) = llm.generate([[10, 11, 12]], p, use_tqdm=False)
            ids = out.outputs[0].token_ids
            assert eos not in ids[:4] and ids[4] == eos and out.outputs[0].finish_reason == "stop", (eos, ids)
    finally:
        llm.shutdown()


def test_the_progress_bar_shows_the_output_rate_of_the_whole_run(fake_llm, monkeypatch):
    bars = []

    class Bar:
        def __init__(self, total, **kw):
            self.total, self.n, self.postfix = total, 0, []
            bars.append(self)

        def update(self, k):
            self.n += k

        def set_postfix_str(self, text, refresh=True):
            self.postfix.append(text)

        def close(self):
            pass

    clock = itertools.chain([0.0], itertools.repeat(2.0))  # the run starts at 0; every request ends at 2 s
    monkeypatch.setattr("llmsvc.llm.time.perf_counter", lambda: next(clock))
    llm = LLM()
    llm.generate(["a", "b", "c"], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=Bar)
    (bar,) = bars
    assert (bar.total, bar.n) == (3, 3)
    assert bar.postfix == ["output: 2.0 toks/s", "output: 4.0 toks/s", "output: 6.0 toks/s"]  # 4, 8, 12 tokens


def test_generate_from_several_threads_runs_each_call_whole(fake_llm):
    # two threads stepping one engine took each other's outputs and failed the scheduler's
    # assertions; calls now wait their turn
    import threading
    llm = LLM(max_num_seqs=4, max_num_batched_tokens=64)
    want = [o.outputs[0].token_ids for o in llm.generate(["a b c", "d e"], SamplingParams(max_tokens=64),
                                                         use_tqdm=False)]
    results, errors = [], []

    def run():
        try:
            results.append([o.outputs[0].token_ids for o in
                            llm.generate(["a b c", "d e"], SamplingParams(max_tokens=64), use_tqdm=False)])
        except Exception as e:  # noqa: BLE001 - reported by the assertion below
            errors.append(e)
    threads = [threading.Thread(target=run) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and results == [want] * 8
    llm.shutdown()
