"""Our models over a paged KV cache == Hugging Face transformers on the same weights (fp32),
for prefill batches, chunked prefill, decode and mixed steps: the Llama family (Llama 3 rope,
Qwen2 bias, Mistral), Qwen3, Phi-3 and Gemma 3, with sliding windows shorter than the prompts.
Longer runs (the engine, the Triton path) are in test_models_families.py."""
from __future__ import annotations

import pytest
import torch

from model_utils import PagedRunner, load_hf_model, load_our_model, make_tiny_model_dir, tiny_hf_config

ATOL = 1e-4

CONFIGS = {
    "llama-untied": dict(arch="llama", tie=False),
    "llama-tied": dict(arch="llama", tie=True),
    "qwen2-bias": dict(arch="qwen2", tie=False),
    "qwen2-tied": dict(arch="qwen2", tie=True),
    "mistral": dict(arch="mistral", tie=False),
    "llama-bias-theta": dict(arch="llama", tie=False, attention_bias=True, mlp_bias=True,
                             rope_parameters={"rope_type": "default", "rope_theta": 500.0}),
    "llama3-rope": dict(arch="llama", tie=True, rope_parameters={
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "linear-rope": dict(arch="llama", rope_parameters={"rope_type": "linear", "rope_theta": 10000.0,
                                                       "factor": 4.0}),
    "yarn-rope": dict(arch="qwen2", rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                     "original_max_position_embeddings": 64}),
    "dynamic-rope": dict(arch="llama", rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0,
                                                        "factor": 2.0}),
    # the families beyond Llama (windows of 12 / 16 tokens: the prompts here are longer)
    "qwen3": dict(arch="qwen3"),
    "qwen3-tied-bias": dict(arch="qwen3", tie=True, attention_bias=True),
    "phi3": dict(arch="phi3"),
    "phi3-partial-rope": dict(arch="phi3", rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                            "partial_rotary_factor": 0.5}),
    "phi3-longrope": dict(arch="phi3", original_max_position_embeddings=128, rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 128,
        "short_factor": [1.0 + 0.25 * i for i in range(8)], "long_factor": [2.0 + i for i in range(8)]}),
    "mistral-window": dict(arch="mistral", sliding_window=12),
    "qwen2-window": dict(arch="qwen2", use_sliding_window=True, sliding_window=12, max_window_layers=1),
    "gemma3": dict(arch="gemma3", tie=True),
    "gemma3-softcap": dict(arch="gemma3", tie=False, final_logit_softcapping=3.0),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    cache = {}

    def get(name):
        if name not in cache:
            d = make_tiny_model_dir(tmp_path_factory.mktemp(name), **CONFIGS[name])
            cache[name] = (load_our_model(d), load_hf_model(d))
        return cache[name]
    return get


def _seqs(n, lens, vocab=320, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (L,), generator=g).tolist() for L in lens[:n]]


@torch.no_grad()
def _hf_logits(hf, tokens):
    return hf(torch.tensor([tokens])).logits[0].float()  # [L, vocab]


def _close(ours, ref):
    assert ours.shape == ref.shape
    err = (ours - ref).abs().max().item()
    assert err < ATOL, f"max abs diff {err}"


@pytest.mark.parametrize("name", list(CONFIGS))
def test_prefill_batch_matches_hf(models, name):
    ours, hf = models(name)
    seqs = _seqs(3, [37, 5, 70], seed=1)
    runner = PagedRunner(ours, num_blocks=32, block_size=16, seed=2)
    out = runner.step(dict(enumerate(seqs)))  # all three flattened in ONE batch
    for i, s in enumerate(seqs):
        _close(out[i], _hf_logits(hf, s))


@pytest.mark.parametrize("name", ["llama-untied", "qwen2-bias", "mistral", "llama3-rope", "yarn-rope", "qwen3",
                                  "phi3", "mistral-window", "gemma3"])
def test_chunked_prefill_matches_hf(models, name):
    ours, hf = models(name)
    (seq,) = _seqs(1, [90], seed=3)
    runner = PagedRunner(ours, num_blocks=40, block_size=4, seed=4)
    chunks = [seq[:17], seq[17:50], seq[50:]]  # chunk borders off block borders
    got = torch.cat([runner.step({0: c})[0] for c in chunks])
    _close(got, _hf_logits(hf, seq))
    assert runner.block_tables[0] != sorted(runner.block_tables[0])  # really non-contiguous


@pytest.mark.parametrize("name", ["llama-tied", "qwen2-tied", "mistral", "linear-rope", "dynamic-rope",
                                  "qwen3-tied-bias", "phi3-partial-rope", "mistral-window", "qwen2-window",
                                  "gemma3-softcap"])
def test_decode_steps_match_hf(models, name):
    ours, hf = models(name)
    seqs = _seqs(3, [20, 33, 9], seed=5)
    runner = PagedRunner(ours, num_blocks=48, block_size=4, seed=6)
    runner.step({i: s[:-6] for i, s in enumerate(seqs)})
    for k in range(6, 0, -1):  # 6 decode steps of all three sequences together
        pos = {i: len(s) - k for i, s in enumerate(seqs)}
        out = runner.step({i: [s[pos[i]]] for i, s in enumerate(seqs)}, last_only=True)
        for i, s in enumerate(seqs):
            _close(out[i], _hf_logits(hf, s[:pos[i] + 1])[-1])


@pytest.mark.parametrize("name", ["llama-untied", "qwen2-bias"])
def test_mixed_prefill_chunks_and_decodes_in_one_step(models, name):
    ours, hf = models(name)
    a, b, c = _seqs(3, [40, 61, 25], seed=7)
    runner = PagedRunner(ours, num_blocks=64, block_size=4, seed=8)
    ref = {n: _hf_logits(hf, s) for n, s in (("a", a), ("b", b), ("c", c))}
    steps = [
        {"a": a[:38], "b": b[:20]},
        {"a": a[38:39], "b": b[20:45], "c": c[:24]},  # decode + chunk + new prompt
        {"b": b[45:], "a": a[39:40], "c": c[24:25]},  # last chunk + two decodes
    ]
    done = {"a": 0, "b": 0, "c": 0}
    for batch in steps:
        out = runner.step(batch)
        for n, toks in batch.items():
            _close(out[n], ref[n][done[n]:done[n] + len(toks)])
            done[n] += len(toks)
    runner.free("a")
    out = runner.step({"a2": a[:12], "c": [c[-1]]})  # freed blocks reused by a new sequence
    _close(out["a2"], ref["a"][:12])


def test_block_table_padding_and_skipped_slots(models):
    ours, hf = models("llama-untied")
    (seq,) = _seqs(1, [10], seed=9)
    runner = PagedRunner(ours, num_blocks=16, block_size=4, seed=1)
    got = runner.step({0: seq})[0]
    _close(got, _hf_logits(hf, seq))
    # a different sequence in a fresh runner must not see stale cache contents
    other = PagedRunner(ours, num_blocks=16, block_size=4, seed=1)
    (seq2,) = _seqs(1, [10], seed=10)
    _close(other.step({0: seq2})[0], _hf_logits(hf, seq2))


@pytest.mark.parametrize("name", ["qwen2-bias", "mistral-window", "gemma3"])
def test_cacheless_forward_matches_hf(models, name):
    """kv_caches=None (profiling path) on full prompts gives the same logits; the 30-token
    prompt runs past the 12 / 16-token windows."""
    ours, hf = models(name)
    from llmsvc.models.layers.attention import AttentionMetadata
    seqs = _seqs(2, [30, 7], seed=11)
    ids = torch.tensor(seqs[0] + seqs[1])
    pos = torch.tensor(list(range(30)) + list(range(7)))
    meta = AttentionMetadata(torch.full((37,), -1, dtype=torch.int64), torch.zeros(2, 1, dtype=torch.int32),
                             torch.tensor([0, 30, 37], dtype=torch.int32), torch.tensor([30, 7], dtype=torch.int32),
                             30, 30)
    with torch.no_grad():
        logits = ours.compute_logits(ours(ids, pos, meta, None))
    _close(logits[:30], _hf_logits(hf, seqs[0]))
    _close(logits[30:], _hf_logits(hf, seqs[1]))


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_bfloat16_runs_close_to_fp32(tmp_path, arch):
    d = make_tiny_model_dir(tmp_path, arch)
    seqs = _seqs(2, [30, 12], seed=12)
    ref = PagedRunner(load_our_model(d)).step(dict(enumerate(seqs)))
    bf = load_our_model(d, dtype="bfloat16")
    assert next(bf.parameters()).dtype == torch.bfloat16
    runner = PagedRunner(bf)
    assert runner.kv_caches[0][0].dtype == torch.bfloat16
    out = runner.step(dict(enumerate(seqs)))
    for i in range(2):
        assert out[i].dtype == torch.float32
        # bf16 has ~3 significant digits; the argmax must mostly agree
        agree = (out[i].argmax(-1) == ref[i].argmax(-1)).float().mean().item()
        assert agree > 0.8, agree


def test_rejects_unknown_checkpoint_tensor(tmp_path):
    from safetensors.torch import load_file, save_file
    d = make_tiny_model_dir(tmp_path, "llama")
    path = f"{d}/model.safetensors"
    sd = load_file(path)
    del sd["model.layers.1.mlp.up_proj.weight"]
    save_file(sd, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="up_proj|gate_up_proj"):
        load_our_model(d)


@pytest.mark.parametrize("name", [n for n in CONFIGS if "rope" in n] + ["llama-untied"])
def test_rope_table_follows_the_build_device(name):
    """build_model builds under `with torch.device(device)`: every rope type's cos/sin table
    must land there (llama3's came back on the CPU and broke loading on CUDA). The meta device
    shows it without a GPU."""
    from llmsvc.models.layers.rotary import get_rope

    cfg = {k: v for k, v in CONFIGS[name].items() if k not in ("arch", "tie")}
    hf_config = tiny_hf_config(CONFIGS[name]["arch"], **cfg)
    cpu = get_rope(hf_config, 16, 64).cos_sin_cache
    with torch.device("meta"):
        rope = get_rope(hf_config, 16, 64)
    assert rope.cos_sin_cache.device.type == "meta"
    assert rope.cos_sin_cache.shape == cpu.shape and cpu.device.type == "cpu"
