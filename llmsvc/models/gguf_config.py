"""What transformers' GGUF conversion drops from a file's metadata, put back into its config.

Shapes, before the weights load (else they do not fit): Qwen3's `attention.key_length` (its
head_dim; transformers assumes 128) and Qwen3-MoE's `expert_feed_forward_length`.

llama.cpp writes a model's RoPE scaling as `{arch}.rope.scaling.*` keys (linear, yarn) or, for
Llama 3's scheme, as a `rope_freqs.weight` tensor of per-frequency divisors. transformers'
GGUF reader ignores both, so the converted config says `rope_type: default` and every position
past a few tokens gets the wrong rotation. Here the keys become `rope_parameters`; the Llama 3
divisors are matched against the scheme's published settings and refused when none fits (a
model is never loaded with a RoPE it does not have).
"""
from __future__ import annotations

import math

import numpy as np

# (factor, low_freq_factor, high_freq_factor, original_max_position_embeddings) of released
# Llama 3.1 / 3.2 / 3.3 models; the file's divisors must be one of these
LLAMA3_SETTINGS = ((8.0, 1.0, 4.0, 8192), (32.0, 1.0, 4.0, 8192), (16.0, 1.0, 4.0, 8192))


def llama3_divisors(inv_freq: np.ndarray, factor, low, high, original) -> np.ndarray:
    """What inv_freq is divided by under Llama 3's scaling (transformers' llama3 rope)."""
    wavelen = 2 * math.pi / inv_freq
    smooth = (original / wavelen - low) / (high - low)
    scaled = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < original / high, 1.0, np.where(wavelen > original / low, factor, scaled))


def rope_from_gguf(reader, arch: str, theta: float, head_dim: int) -> dict | None:
    """The rope_parameters updates a GGUF file asks for (None: plain RoPE). ValueError for a
    scaling this cannot reproduce."""
    def field(key):
        f = reader.fields.get(key)
        return None if f is None else f.contents()

    kind = field(f"{arch}.rope.scaling.type")
    factor = field(f"{arch}.rope.scaling.factor")
    original = field(f"{arch}.rope.scaling.original_context_length")
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is not None:
        divisors = np.asarray(freqs.data, dtype=np.float64).reshape(-1)
        inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
        for f, low, high, orig in LLAMA3_SETTINGS:
            if len(divisors) == len(inv_freq) and np.allclose(llama3_divisors(inv_freq, f, low, high, orig),
                                                              divisors, rtol=1e-3):
                return {"rope_type": "llama3", "factor": f, "low_freq_factor": low, "high_freq_factor": high,
                        "original_max_position_embeddings": orig}
        raise ValueError("its rope_freqs tensor (per-frequency RoPE divisors) matches none of Llama 3's "
                         "settings; it cannot be served with the RoPE it was trained with")
    if kind in (None, "none") or not factor or factor == 1.0:
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn":
        out = {"rope_type": "yarn", "factor": float(factor)}
        if original:
            out["original_max_position_embeddings"] = int(original)
        for key, name in (("attn_factor", "attention_factor"), ("yarn_beta_fast", "beta_fast"),
                          ("yarn_beta_slow", "beta_slow")):
            value = field(f"{arch}.rope.scaling.{key}")
            if value:
                out[name] = float(value)
        return out
    raise ValueError(f"its RoPE scaling {kind!r} is not supported (linear, yarn, Llama 3's rope_freqs)")


def shape_overrides(reader) -> dict:
    """Config attributes the file (a gguf.GGUFReader) states and transformers' reader does not take."""
    arch = reader.fields["general.architecture"].contents()
    out = {}
    if arch in ("qwen3", "qwen3moe"):
        key_length = reader.fields.get(f"{arch}.attention.key_length")
        if key_length is not None:
            out["head_dim"] = int(key_length.contents())
    if arch == "qwen3moe":
        expert = reader.fields.get(f"{arch}.expert_feed_forward_length")
        if expert is not None:
            out["moe_intermediate_size"] = int(expert.contents())
    return out


def fix_converted_config(config: dict, reader) -> dict:
    """config.json of a converted GGUF with the file's RoPE scaling (and, for Gemma 3, the
    attention scale llama.cpp uses: hidden / heads for the 62-layer 27B, else head_dim)."""
    arch = reader.fields["general.architecture"].contents()
    rope = dict(config.get("rope_parameters") or {})
    nested = arch == "gemma3" and "full_attention" in rope  # Gemma 3: one entry per layer type
    full = dict(rope["full_attention"]) if nested else rope
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    update = rope_from_gguf(reader, arch, float(full.get("rope_theta", 10000.0)), head_dim)
    if update:
        full.update(update)  # Gemma 3: only the global layers are scaled
        config["rope_parameters"] = {**rope, "full_attention": full} if nested else full
    if arch == "gemma3":
        layers, heads = config["num_hidden_layers"], config["num_attention_heads"]
        config["query_pre_attn_scalar"] = config["hidden_size"] // heads if layers == 62 else head_dim
    return config
