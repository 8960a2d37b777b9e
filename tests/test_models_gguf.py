"""GGUF files of each family load into the same weights as the HF checkpoint they came from.

The test writes tiny GGUF files itself, as llama.cpp's convert_hf_to_gguf.py does: its
tensor names (gguf-py's name map), its metadata keys, and its per-family conventions
(llama: q/k rows permuted for its interleaved RoPE; gemma3: norm weights stored as 1 + w,
the LM head dropped for the tied embeddings; phi3: qkv and gate/up stay fused; qwen3: q/k
norms). llmsvc converts a .gguf once through transformers' GGUF reader (resolve_model_dir);
the converted model must equal the source checkpoint parameter for parameter.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from llmsvc.config import ModelConfig
from llmsvc.models.loader_names import layer_sliding_windows
from llmsvc.models.resolve import resolve_model_config, resolve_model_dir
from model_utils import PagedRunner, load_hf_model, load_our_model, make_tiny_model_dir
from server_harness import TINY_VOCAB, tiny_tokenizer

gguf = pytest.importorskip("gguf")

# family -> (gguf architecture, tiny config: values llama.cpp's metadata can carry)
FAMILIES = {
    "llama": ("llama", dict(arch="llama", tie=False)),
    "qwen2": ("qwen2", dict(arch="qwen2", tie=True)),
    "qwen3": ("qwen3", dict(arch="qwen3", head_dim=32)),  # from attention.key_length (transformers assumed 128)
    "phi3": ("phi3", dict(arch="phi3")),
    # default layer pattern (every 6th layer global) and local base; the query scalar llama.cpp
    # assumes for every Gemma 3 but the 27B (a GGUF carries none): head_dim
    "gemma3": ("gemma3", dict(arch="gemma3", tie=True, num_hidden_layers=2, sliding_window=16, layer_types=None,
                              query_pre_attn_scalar=32, rope_parameters=None)),
}


def _llama_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's q/k row order (pairs interleaved per head) from HF's (halves)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model_dir: str, path: str, arch: str, quant=None) -> None:
    """quant: None, or {substring of an HF tensor name: gguf.GGMLQuantizationType, None, or a
    function array -> (raw blocks, type)} for the tensors to store in that type (the first
    match wins; None and no match: F32). gguf-py cannot quantize K-quants: a function may
    write any blocks."""
    import transformers
    from safetensors.torch import load_file

    cfg = transformers.AutoConfig.from_pretrained(model_dir)
    state = load_file(f"{model_dir}/model.safetensors")
    names = gguf.get_tensor_name_map(next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch),
                                     cfg.num_hidden_layers)
    w = gguf.GGUFWriter(path, arch)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_uint32(f"{arch}.vocab_size", cfg.vocab_size)
    theta = cfg.rope_parameters["full_attention" if arch == "gemma3" else "rope_theta"]
    w.add_rope_freq_base(theta["rope_theta"] if arch == "gemma3" else theta)
    if arch == "llama":
        w.add_rope_dimension_count(cfg.head_dim)
    rope = cfg.rope_parameters.get("full_attention", cfg.rope_parameters) if arch == "gemma3" else cfg.rope_parameters
    if rope and rope.get("rope_type") == "llama3":  # llama.cpp: per-frequency divisors in a tensor
        from llmsvc.models.gguf_config import llama3_divisors
        inv = 1.0 / rope["rope_theta"] ** (np.arange(0, cfg.head_dim, 2, dtype=np.float64) / cfg.head_dim)
        w.add_tensor("rope_freqs.weight", llama3_divisors(
            inv, rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"],
            rope["original_max_position_embeddings"]).astype(np.float32))
    elif rope and rope.get("rope_type") in ("linear", "yarn"):
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR if rope["rope_type"] == "linear"
                                else gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        if "original_max_position_embeddings" in rope:
            w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    if arch == "qwen3":
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    if arch == "gemma3":
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
        w.add_sliding_window(cfg.sliding_window)
    tok = tiny_tokenizer()
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    assert [i for _, i in vocab] == list(range(TINY_VOCAB))
    w.add_tokenizer_model("gpt2")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([gguf.TokenType.CONTROL if t.startswith("<|") else gguf.TokenType.NORMAL for t, _ in vocab])
    w.add_token_scores([0.0] * len(vocab))  # no merges: transformers derives none from a byte vocabulary
    w.add_bos_token_id(cfg.bos_token_id)
    w.add_eos_token_id(cfg.eos_token_id)
    w.add_pad_token_id(cfg.pad_token_id)
    for name, t in state.items():
        if arch == "gemma3" and name == "lm_head.weight":
            continue
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
            t = _llama_permute(t, heads)
        if arch == "gemma3" and name.endswith("norm.weight"):
            t = t + 1
        gname = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gname is not None, name
        data = np.ascontiguousarray(t.float().numpy())
        qtype = next((q for key, q in (quant or {}).items() if key in name), None)
        if qtype is None:
            w.add_tensor(gname, data)
        elif callable(qtype):
            raw, kind = qtype(data)
            w.add_tensor(gname, raw, raw_dtype=kind)
        else:
            w.add_tensor(gname, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_gguf_loads_the_checkpoint_weights(tmp_path, monkeypatch, family):
    monkeypatch.setenv("LLMSVC_CACHE", str(tmp_path / "cache"))
    arch, cfg = FAMILIES[family]
    src = make_tiny_model_dir(tmp_path, **{**cfg, "vocab_size": TINY_VOCAB})
    path = str(tmp_path / f"{family}.gguf")
    write_gguf(src, path, arch)
    converted = resolve_model_dir(path)
    mc_src = resolve_model_config(ModelConfig(model=src))
    mc_gguf = resolve_model_config(ModelConfig(model=path))
    assert mc_gguf.architecture == mc_src.architecture
    assert layer_sliding_windows(mc_gguf.hf_config) == layer_sliding_windows(mc_src.hf_config)
    ours, theirs = dict(load_our_model(converted).named_parameters()), dict(load_our_model(src).named_parameters())
    assert ours.keys() == theirs.keys()
    for name in ours:
        # gemma's norm weights go through (1 + w) - 1 in fp32: the last bit may differ
        tol = 1e-6 if family == "gemma3" and name.endswith("norm.weight") else 0.0
        torch.testing.assert_close(ours[name], theirs[name], atol=tol, rtol=0, msg=name)
    # and the converted model computes what transformers computes on the source checkpoint
    ids = torch.arange(3, 40)
    hf = load_hf_model(src)
    got = PagedRunner(load_our_model(converted), num_blocks=8, block_size=16).step({0: ids.tolist()})[0]
    with torch.no_grad():
        torch.testing.assert_close(got, hf(ids[None]).logits[0].float(), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family, rope", [
    ("llama", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}),
    ("llama", {"rope_type": "linear", "factor": 4.0}),
    ("qwen2", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
])
def test_gguf_rope_scaling_is_kept(tmp_path, monkeypatch, family, rope):
    # transformers' GGUF reader drops it (the converted config said "default"): past a few
    # positions every logit was off
    monkeypatch.setenv("LLMSVC_CACHE", str(tmp_path / "cache"))
    arch, cfg = FAMILIES[family]
    src = make_tiny_model_dir(tmp_path, **{**cfg, "vocab_size": TINY_VOCAB,
                                           "rope_parameters": {"rope_theta": 10000.0, **rope}})
    path = str(tmp_path / f"{family}.gguf")
    write_gguf(src, path, arch)
    converted = resolve_model_dir(path)
    ids = torch.arange(3, 120) % TINY_VOCAB
    got = PagedRunner(load_our_model(converted), num_blocks=16, block_size=16).step({0: ids.tolist()})[0]
    with torch.no_grad():
        ref = load_hf_model(src)(ids[None]).logits[0].float()
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_gguf_rope_divisors_of_no_known_setting_are_refused(tmp_path, monkeypatch):
    from llmsvc.models.gguf_config import rope_from_gguf

    class Reader:  # a rope_freqs tensor of made-up divisors
        fields = {}
        tensors = [type("T", (), {"name": "rope_freqs.weight", "data": np.linspace(1, 3, 16)})()]
    with pytest.raises(ValueError, match="matches none of Llama 3's settings"):
        rope_from_gguf(Reader(), "llama", 10000.0, 32)
