"""The Triton ops registered as torch.library custom ops (namespace "llmsvc").

Registering them keeps torch.compile (and CUDA-graph capture through it) away from the raw
kernel launches, and gives each op a fake implementation for shape propagation. Only
imported when triton is available; `kernels/ops.py` decides when these are called.
"""
from __future__ import annotations

from typing import Optional

import torch

from kernels.triton_ops import fused_moe as _moe
from kernels.triton_ops import lora as _lora
from kernels.triton_ops import paged_attention as _attn
from kernels.triton_ops import rms_norm as _norm
from kernels.triton_ops import rotary_embedding as _rope
from kernels.triton_ops import silu_and_mul as _act
from kernels.triton_ops import store_kv as _kv


@torch.library.custom_op("llmsvc::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _norm.rms_norm(x, weight, eps)


@rms_norm.register_fake
def _(x, weight, eps):
    return torch.empty_like(x)


@torch.library.custom_op("llmsvc::fused_add_rms_norm", mutates_args=())
def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _norm.fused_add_rms_norm(x, residual, weight, eps)


@fused_add_rms_norm.register_fake
def _(x, residual, weight, eps):
    return torch.empty_like(x), torch.empty_like(x)


@torch.library.custom_op("llmsvc::silu_and_mul", mutates_args=())
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return _act.silu_and_mul(x)


@silu_and_mul.register_fake
def _(x):
    return x.new_empty((x.shape[0], x.shape[1] // 2))


@torch.library.custom_op("llmsvc::rotary_embedding", mutates_args=("query", "key"))
def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                     cos_sin_cache: torch.Tensor, head_size: int) -> None:
    _rope.rotary_embedding(positions, query, key, cos_sin_cache, head_size)


@rotary_embedding.register_fake
def _(positions, query, key, cos_sin_cache, head_size):
    return None


@torch.library.custom_op("llmsvc::store_kv", mutates_args=("k_cache", "v_cache"))
def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    _kv.store_kv(key, value, k_cache, v_cache, slot_mapping)


@store_kv.register_fake
def _(key, value, k_cache, v_cache, slot_mapping):
    return None


@torch.library.custom_op("llmsvc::paged_attention", mutates_args=())
def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                    seq_lens: torch.Tensor, scale: float, max_query_len: Optional[int] = None,
                    max_seq_len: Optional[int] = None,
                    decode_split_size: Optional[int] = None, sliding_window: int = 0,
                    soft_cap: float = 0.0) -> torch.Tensor:
    return _attn.paged_attention(query, k_cache, v_cache, block_tables, query_start_loc, seq_lens,
                                 scale, max_query_len=max_query_len, max_seq_len=max_seq_len,
                                 decode_split_size=decode_split_size, sliding_window=sliding_window,
                                 soft_cap=soft_cap)


@paged_attention.register_fake
def _(query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale,
      max_query_len=None, max_seq_len=None, decode_split_size=None, sliding_window=0, soft_cap=0.0):
    return torch.empty_like(query, memory_format=torch.contiguous_format)


@torch.library.custom_op("llmsvc::fused_moe", mutates_args=())
def fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
    return _moe.fused_moe(hidden, w13, w2, topk_weights, topk_ids)


@fused_moe.register_fake
def _(hidden, w13, w2, topk_weights, topk_ids):
    return torch.empty_like(hidden, memory_format=torch.contiguous_format)


@torch.library.custom_op("llmsvc::lora_add_", mutates_args=("y",))
def lora_add_(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
              token_slots: torch.Tensor) -> None:
    _lora.lora_add_(y, x, lora_a, lora_b, token_slots)


@lora_add_.register_fake
def _(y, x, lora_a, lora_b, token_slots):
    return None
