"""Paged attention and the KV store on the CPU through the native kernels (`paged_attention.c`).

The torch reference runs it as a gather of every sequence's K/V blocks followed by SDPA
(two extra copies of the cache per layer); the kernel reads K/V in place through the
block table, fp32 math, fp32 or bf16 storage.
"""
from __future__ import annotations

import torch

from kernels.cpu_ops.build import DTYPE_CODES as _DTYPES, as_c_array, as_c_rows, load


def available() -> bool:
    return load() is not None


def supports(query: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """True when `paged_attention` can take these tensors (CPU, fp32 / bf16, one dtype,
    head_dim a multiple of 16 up to 512)."""
    return (query.is_cpu and query.dtype in _DTYPES and k_cache.dtype == query.dtype
            and query.shape[-1] % 16 == 0 and query.shape[-1] <= 512 and available())


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                    seq_lens: torch.Tensor, scale: float, sliding_window: int = 0,
                    soft_cap: float = 0.0) -> torch.Tensor:
    """Same contract as `kernels.reference.paged_attention`; query: [T, Hq, D] (rows may be
    strided, heads contiguous), caches [num_blocks, block_size, Hkv, D] contiguous."""
    lib = load()
    t, hq, d = query.shape
    nb, bs, hkv, dk = k_cache.shape
    if lib is None or not supports(query, k_cache):
        raise RuntimeError("CPU paged attention: unsupported input or kernels not built")
    if query.stride(2) != 1 or query.stride(1) != d:
        query = query.contiguous()
    assert dk == d and v_cache.shape == k_cache.shape and v_cache.dtype == k_cache.dtype
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and hq % hkv == 0
    bt = as_c_rows(block_tables, torch.int32)
    qsl, sl = as_c_array(query_start_loc, torch.int32), as_c_array(seq_lens, torch.int32)
    out = torch.empty((t, hq, d), dtype=query.dtype)
    rc = lib.llmsvc_paged_attention(_DTYPES[query.dtype], query.data_ptr(), query.stride(0),
                                    k_cache.data_ptr(), v_cache.data_ptr(), bt.data_ptr(),
                                    bt.stride(0), qsl.data_ptr(), sl.data_ptr(), sl.shape[0],
                                    hq, hkv, d, bs, float(scale), int(sliding_window), float(soft_cap),
                                    out.data_ptr(),
                                    torch.get_num_threads())
    if rc != 0:
        raise ValueError("CPU paged attention rejected its arguments (q_len > seq_len, or bad shapes)")
    return out


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Same contract as `kernels.reference.store_kv`: key, value [T, Hkv, D] (rows may be
    strided, heads contiguous) into contiguous caches [num_blocks, block_size, Hkv, D]."""
    t, h, d = key.shape
    nb, bs = k_cache.shape[:2]
    if key.stride(2) != 1 or key.stride(1) != d:
        key = key.contiguous()
    if value.stride(2) != 1 or value.stride(1) != d:
        value = value.contiguous()
    if key.dtype != k_cache.dtype or value.dtype != k_cache.dtype:
        key, value = key.to(k_cache.dtype), value.to(k_cache.dtype)
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape[2:] == (h, d)
    slots = as_c_array(slot_mapping, torch.int64)
    rc = load().llmsvc_store_kv(key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0),
                                k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(), t, h * d,
                                nb * bs, k_cache.element_size())
    if rc != 0:
        raise ValueError("CPU store_kv: a slot is outside the cache")
