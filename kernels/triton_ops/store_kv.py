"""Paged KV store: key/value rows scattered into the cache by slot mapping."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_ops._utils import check_float, check_same_device, next_pow2


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_cs, stride_ch, num_kv_heads, head_size,
                     H_PAD: tl.constexpr, D_PAD: tl.constexpr):
    # key/value: [T, Hkv, D]; k_cache/v_cache viewed as [num_blocks * block_size, Hkv, D]
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)  # -1 = padding token, skipped
    h = tl.arange(0, H_PAD)[:, None]
    d = tl.arange(0, D_PAD)[None, :]
    heads = tl.where(slot >= 0, num_kv_heads, 0)  # a skipped token masks every head
    mask = (h < heads) & (d < head_size)
    k = tl.load(k_ptr + tok * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(v_ptr + tok * stride_vt + h * stride_vh + d, mask=mask)
    dst = slot * stride_cs + h * stride_ch + d  # int64: slot * stride_cs can pass 2^31
    tl.store(kc_ptr + dst, k.to(kc_ptr.dtype.element_ty), mask=mask)
    tl.store(vc_ptr + dst, v.to(vc_ptr.dtype.element_ty), mask=mask)


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """In place. key, value: [T, Hkv, D]; caches [num_blocks, block_size, Hkv, D]; slot -1 skipped."""
    assert key.dim() == 3 and value.shape == key.shape, f"key {tuple(key.shape)} value {tuple(value.shape)}"
    assert k_cache.dim() == 4 and v_cache.shape == k_cache.shape
    t, h, d = key.shape
    assert k_cache.shape[2:] == (h, d), f"cache {tuple(k_cache.shape)} vs key {tuple(key.shape)}"
    assert slot_mapping.shape == (t,) and slot_mapping.dtype in (torch.int64, torch.int32)
    assert key.stride(2) == 1 and value.stride(2) == 1
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    for name, x in (("key", key), ("value", value), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_float(name, x)
    check_same_device(key, value, k_cache, v_cache, slot_mapping)
    if t == 0:
        return
    _store_kv_kernel[(t,)](key, value, k_cache, v_cache, slot_mapping.contiguous(),
                           key.stride(0), key.stride(1), value.stride(0), value.stride(1),
                           k_cache.stride(1), k_cache.stride(2), h, d,
                           H_PAD=next_pow2(h), D_PAD=next_pow2(d))
