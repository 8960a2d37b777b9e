"""Neox-style rotary embedding applied in place to q and k; one program per token."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_ops._utils import check_float, check_last_contiguous, check_same_device, next_pow2


@triton.jit
def _rotate_heads(x_ptr, row_off, num_heads, cos, sin, head_size, half,
                  H_PAD: tl.constexpr, HALF_PAD: tl.constexpr):
    # x row: [num_heads * head_size]; rotates x[h, :half] and x[h, half:2*half] with cos/sin [HALF_PAD]
    h = tl.arange(0, H_PAD)[:, None]
    i = tl.arange(0, HALF_PAD)[None, :]
    mask = (h < num_heads) & (i < half)
    p1 = x_ptr + row_off + h * head_size + i  # [H_PAD, HALF_PAD]
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p1 + half, mask=mask, other=0.0).to(tl.float32)
    o1 = x1 * cos[None, :] - x2 * sin[None, :]
    o2 = x2 * cos[None, :] + x1 * sin[None, :]
    tl.store(p1, o1.to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(p1 + half, o2.to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(pos_ptr, q_ptr, k_ptr, cache_ptr, stride_q, stride_k, stride_c,
                 num_q_heads, num_kv_heads, head_size, half,
                 HQ_PAD: tl.constexpr, HKV_PAD: tl.constexpr, HALF_PAD: tl.constexpr):
    # positions: [T] int64; q: [T, Hq*D]; k: [T, Hkv*D]; cos_sin_cache: [max_pos, 2*half]
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    i = tl.arange(0, HALF_PAD)
    cmask = i < half
    cos = tl.load(cache_ptr + pos * stride_c + i, mask=cmask, other=0.0).to(tl.float32)
    sin = tl.load(cache_ptr + pos * stride_c + half + i, mask=cmask, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr, tok * stride_q, num_q_heads, cos, sin, head_size, half, HQ_PAD, HALF_PAD)
    _rotate_heads(k_ptr, tok * stride_k, num_kv_heads, cos, sin, head_size, half, HKV_PAD, HALF_PAD)


def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                     cos_sin_cache: torch.Tensor, head_size: int) -> None:
    """In place. positions [T] int64, query [T, Hq*D], key [T, Hkv*D], cos_sin_cache [P, rot]."""
    assert positions.dim() == 1 and positions.dtype in (torch.int64, torch.int32)
    t = positions.shape[0]
    assert query.dim() == 2 and key.dim() == 2 and query.shape[0] == t and key.shape[0] == t, \
        f"query {tuple(query.shape)} / key {tuple(key.shape)} vs {t} positions"
    assert query.shape[1] % head_size == 0 and key.shape[1] % head_size == 0
    assert cos_sin_cache.dim() == 2 and cos_sin_cache.shape[1] % 2 == 0
    rot = cos_sin_cache.shape[1]
    assert rot <= head_size, f"rotary_dim {rot} > head_size {head_size}"
    for name, x in (("query", query), ("key", key), ("cos_sin_cache", cos_sin_cache)):
        check_float(name, x)
        check_last_contiguous(name, x)
    assert query.dtype == key.dtype
    assert positions.is_contiguous()
    check_same_device(positions, query, key, cos_sin_cache)
    if t == 0:
        return
    hq, hkv = query.shape[1] // head_size, key.shape[1] // head_size
    half = rot // 2
    _rope_kernel[(t,)](positions, query, key, cos_sin_cache,
                       query.stride(0), key.stride(0), cos_sin_cache.stride(0),
                       hq, hkv, head_size, half,
                       HQ_PAD=next_pow2(hq), HKV_PAD=next_pow2(hkv), HALF_PAD=next_pow2(half))
