"""Qwen3, Phi-3, Mistral with a real sliding window, Gemma 3 (and Llama 3 / Qwen2 as before)
against transformers on tiny random checkpoints, over long runs:

- through the engine (LLM: scheduler, chunked prefill under a 16-token budget, paged KV
  cache of 4-token blocks, prefix caching): 24 greedy tokens equal transformers' generate,
  for prompts longer than every sliding window;
- on the Triton path (interpreter): chunked prefill then decode steps give HF's logits;
- sharded safetensors checkpoints (save_pretrained(max_shard_size=...)) load the same weights.
"""
from __future__ import annotations

import pytest
import torch

from kernels import ops
from kernels.triton_ops import HAS_TRITON, INTERPRET
from model_utils import PagedRunner, load_hf_model, load_our_model, make_tiny_model_dir
from server_harness import TINY_VOCAB, tiny_tokenizer
from test_models import CONFIGS

ENGINE_FAMILIES = ["llama3-rope", "qwen2-bias", "qwen3", "phi3-partial-rope", "mistral-window", "qwen2-window",
                   "gemma3", "gemma3-softcap"]
NEW_TOKENS = 24
needs_triton = pytest.mark.skipif(not (HAS_TRITON and INTERPRET), reason="Triton interpreter not available")


def _model_dir(tmp_path, name: str) -> str:
    """The tiny model with tiny_tokenizer() saved beside it (the engine loads a tokenizer)."""
    d = make_tiny_model_dir(tmp_path, **{**CONFIGS[name], "vocab_size": TINY_VOCAB})
    tiny_tokenizer().save_pretrained(d)
    return d


def _prompts(n: int, lens: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 250, (length,), generator=g).tolist() for length in lens[:n]]


@torch.no_grad()
def _hf_generate(hf, prompt: list[int], n: int) -> list[int]:
    hf.generation_config.eos_token_id = None  # run all n tokens, past any EOS
    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                      max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _engine_tokens(model_dir: str, prompts: list[list[int]], **kw) -> list[list[int]]:
    from llmsvc import LLM, SamplingParams
    llm = LLM(model_dir, **{"max_num_seqs": 4, "max_num_batched_tokens": 16, "block_size": 4,
                            "num_kv_blocks_override": 96, **kw})
    try:
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
        outs = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.llm_engine.get_stats()
        assert stats.num_free_kv_blocks == stats.num_kv_blocks  # nothing leaked
        return [list(o.outputs[0].token_ids) for o in outs]
    finally:
        llm.shutdown()


@pytest.mark.parametrize("name", ENGINE_FAMILIES)
def test_engine_greedy_equals_transformers_generate(tmp_path, name):
    d = _model_dir(tmp_path, name)
    prompts = _prompts(3, [45, 29, 38], seed=ENGINE_FAMILIES.index(name))  # > every window (12, 16)
    got = _engine_tokens(d, prompts)
    hf = load_hf_model(d)
    for p, g in zip(prompts, got):
        assert g == _hf_generate(hf, p, NEW_TOKENS)


@needs_triton
@pytest.mark.parametrize("name", ["mistral-window", "gemma3"])
def test_engine_greedy_on_the_triton_path(tmp_path, name):
    d = _model_dir(tmp_path, name)
    prompts = _prompts(2, [33, 21], seed=40)
    with ops.force_triton():
        got = _engine_tokens(d, prompts)
    hf = load_hf_model(d)
    for p, g in zip(prompts, got):
        assert g == _hf_generate(hf, p, NEW_TOKENS)


@needs_triton
@pytest.mark.parametrize("name", ["qwen3", "phi3", "mistral-window", "qwen2-window", "gemma3-softcap"])
def test_triton_path_logits_match_hf(tmp_path, name):
    """Chunks across the window start, then decodes past it, every op on the Triton path."""
    d = make_tiny_model_dir(tmp_path, **CONFIGS[name])
    ours, hf = load_our_model(d), load_hf_model(d)
    (seq,) = _prompts(1, [50], seed=7)
    runner = PagedRunner(ours, num_blocks=24, block_size=4, seed=2)
    for k_cache, v_cache in runner.kv_caches:  # unwritten slots: NaN, must stay unread
        k_cache.fill_(float("nan"))
        v_cache.fill_(float("nan"))
    with ops.force_triton(), torch.no_grad():
        got = [runner.step({0: seq[:19]})[0], runner.step({0: seq[19:44]})[0]]
        got += [runner.step({0: [t]})[0] for t in seq[44:]]
        ref = hf(torch.tensor([seq])).logits[0].float()
    got = torch.cat(got)
    assert not torch.isnan(got).any()
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["phi3", "gemma3"])
def test_sharded_checkpoint_loads_the_same_weights(tmp_path, name):
    import os

    d = make_tiny_model_dir(tmp_path, **CONFIGS[name])
    hf = load_hf_model(d)
    sharded = str(tmp_path / "sharded")
    hf.save_pretrained(sharded, max_shard_size="40KB")
    assert os.path.isfile(os.path.join(sharded, "model.safetensors.index.json"))
    assert len([f for f in os.listdir(sharded) if f.endswith(".safetensors")]) > 2
    one, many = load_our_model(d), load_our_model(sharded)
    a, b = dict(one.named_parameters()), dict(many.named_parameters())
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_engine_frees_blocks_behind_the_window_and_keeps_hf_tokens(tmp_path, monkeypatch):
    """Mistral with a 12-token window: a request holds about (window + step budget) / block_size
    blocks however long it gets, and its tokens stay transformers'."""
    from llmsvc.core.kv_cache_manager import KVCacheManager

    held: list[int] = []
    allocate = KVCacheManager.allocate_slots

    def recording(self, request, *a, **kw):
        out = allocate(self, request, *a, **kw)
        held.append(self.num_held_blocks(request.request_id))
        return out
    monkeypatch.setattr(KVCacheManager, "allocate_slots", recording)
    d = _model_dir(tmp_path, "mistral-window")
    prompts = _prompts(1, [90], seed=11)
    got = _engine_tokens(d, prompts)
    assert got[0] == _hf_generate(load_hf_model(d), prompts[0], NEW_TOKENS)
    # 90 + 24 tokens would fill 29 blocks of 4; window 12 + a 16-token chunk span at most 8
    assert max(held) <= -(-(12 + 16) // 4) + 1, held
    assert len(held) > (90 // 16) + NEW_TOKENS - 2  # every step was recorded


@pytest.mark.parametrize("name, pool_bound", [("mistral-window", False), ("llama3-rope", True)])
def test_a_window_lets_requests_outgrow_the_pool(tmp_path, name, pool_bound):
    """22 blocks of 4 (88 tokens): with a 12-token window on every layer a request holds at most
    (12 + 16) / 4 + 1 = 8 of them, so a 100-token prompt runs, with transformers' tokens; a
    model with full attention is bound by the pool."""
    from llmsvc import LLM, SamplingParams
    from llmsvc.core.errors import PromptTooLongError
    from llmsvc.engine_request import EngineRequest

    d = _model_dir(tmp_path, name)
    prompts = _prompts(1, [100], seed=5)
    if pool_bound:
        llm = LLM(d, max_num_batched_tokens=16, block_size=4, num_kv_blocks_override=22)
        try:
            assert llm.llm_engine.max_model_len == 88
            with pytest.raises(PromptTooLongError, match="the KV cache pool"):
                llm.llm_engine.admit(EngineRequest("r", prompts[0], SamplingParams(max_tokens=NEW_TOKENS)))
        finally:
            llm.shutdown()
        return
    got = _engine_tokens(d, prompts, num_kv_blocks_override=22)
    assert got[0] == _hf_generate(load_hf_model(d), prompts[0], NEW_TOKENS)
