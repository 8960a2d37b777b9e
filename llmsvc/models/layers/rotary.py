"""Rotary position embedding (neox style) with Hugging Face's rope scaling.

The inverse frequencies and the attention factor come from transformers' own rope
init functions (`ROPE_INIT_FUNCTIONS`), so every scaling type a config carries
(linear, dynamic, llama3, yarn, ...) matches HF exactly. cos/sin are precomputed for
positions [0, max_position) into

  cos_sin_cache: [max_position, rotary_dim] float32, cos in the first half, sin in the
                 second, both multiplied by the attention factor (yarn's mscale).

"dynamic" (NTK) scaling is evaluated once at init for `max_position`. HF recomputes
the frequencies only when a sequence grows past max_position_embeddings, which
resolve_model_config forbids (max_model_len <= max_position_embeddings), so the static
cache equals HF's for every position we can see. "longrope" (Phi-3 / su scaling) takes its
short factors, which HF uses while a sequence stays within original_max_position_embeddings;
past it HF switches every position to the long factors, so resolve_model_config caps
max_model_len there.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from kernels import ops
from llmsvc.models.hf_config import HFConfig

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")


def rope_parameters(hf_config, layer_type: str | None = None) -> dict:
    """The config's rope dict (transformers v5 `rope_parameters`, v4 `rope_scaling`), with
    `rope_type` and `rope_theta` always present. layer_type: the entry for that layer type
    where the config keeps one per type (Gemma 3: "sliding_attention", "full_attention")."""
    params = dict(getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {})
    if layer_type is not None:
        params = dict(params[layer_type])
    params.setdefault("rope_type", params.get("type", "default"))
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    return params


def compute_inv_freq(hf_config, head_size: int, layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    """(inv_freq [rotary_dim / 2] float32 on the CPU, attention_factor) as HF computes them."""
    params = rope_parameters(hf_config, layer_type)
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise NotImplementedError(f"rope type {rope_type!r} is not supported ({', '.join(SUPPORTED_ROPE_TYPES)})")
    if rope_type == "default":
        dim = int(head_size * params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0)))
        base = float(params["rope_theta"])
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float, device="cpu") / dim))
        return inv_freq, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    if isinstance(hf_config, HFConfig):  # transformers' rope functions call config methods
        hf_config = hf_config.to_transformers()
    with torch.device("cpu"):  # whatever device the model is being built on
        kw = {} if layer_type is None else {"layer_type": layer_type}  # longrope: no seq_len = short factors
        inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"), **kw)
    return inv_freq.float(), float(attention_factor)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_size: int, max_position: int, hf_config, layer_type: str | None = None):
        super().__init__()
        self.head_size = head_size
        inv_freq, self.attention_factor = compute_inv_freq(hf_config, head_size, layer_type)
        self.rotary_dim = 2 * inv_freq.numel()
        # computed on the CPU whatever the device (the same table everywhere), then moved to the
        # device the model is being built on (`with torch.device(...)` in build_model)
        t = torch.arange(max_position, dtype=torch.float, device="cpu")
        freqs = t[:, None] * inv_freq[None, :]  # [max_position, rotary_dim / 2]
        cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1) * self.attention_factor
        self.register_buffer("cos_sin_cache", cache.to(torch.get_default_device()),
                             persistent=False)  # [max_position, rotary_dim]

    def forward(self, positions: torch.Tensor, query: torch.Tensor,
                key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T] int64; query: [T, Hq * head_size], key: [T, Hkv * head_size], rotated in place."""
        ops.rotary_embedding(positions, query, key, self.cos_sin_cache, self.head_size)
        return query, key


def get_rope(hf_config, head_size: int, max_position: int | None = None,
             layer_type: str | None = None) -> RotaryEmbedding:
    return RotaryEmbedding(head_size, max_position or hf_config.max_position_embeddings, hf_config, layer_type)
