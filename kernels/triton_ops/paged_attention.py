"""Wrapper for paged attention: varlen kernel for prefill chunks, split-K kernel for decodes.

Nothing here reads device tensors on the host when the max_query_len / max_seq_len hints are
given, so the call can be captured in a CUDA graph. Without hints they are computed (a sync).
"""
from __future__ import annotations

import torch
import triton

from kernels.triton_ops import DEFAULT_DECODE_SPLIT
from kernels.triton_ops._utils import check_float, check_same_device, next_pow2
from kernels.triton_ops.paged_decode import _decode_reduce_kernel, _decode_split_kernel
from kernels.triton_ops.varlen_attention import _varlen_attn_kernel

BLOCK_M = 64  # query rows (tokens x grouped heads) per varlen program
BLOCK_N = 32  # keys per inner iteration


def _dot_precision(dtype: torch.dtype) -> str:
    # 16-bit inputs are exact in tf32; fp32 inputs ask for full ieee products
    return "ieee" if dtype == torch.float32 else "tf32"


def _check(query, k_cache, v_cache, block_tables, query_start_loc, seq_lens) -> None:
    assert query.dim() == 3, f"query must be [T, Hq, D], got {tuple(query.shape)}"
    assert k_cache.dim() == 4 and v_cache.shape == k_cache.shape, \
        f"caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)}"
    _, hq, d = query.shape
    _, _, hkv, dc = k_cache.shape
    assert dc == d, f"head_dim {d} vs cache {dc}"
    assert hq % hkv == 0, f"num_heads {hq} not a multiple of num_kv_heads {hkv}"
    assert query.stride(2) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert k_cache.dtype == v_cache.dtype
    check_float("query", query)
    check_float("k_cache", k_cache)
    b = seq_lens.shape[0]
    assert block_tables.dim() == 2 and block_tables.shape[0] >= b and block_tables.dtype == torch.int32
    assert block_tables.stride(1) == 1
    assert query_start_loc.shape == (b + 1,) and query_start_loc.dtype == torch.int32
    assert seq_lens.dtype == torch.int32
    assert query_start_loc.is_contiguous() and seq_lens.is_contiguous()
    check_same_device(query, k_cache, v_cache, block_tables, query_start_loc, seq_lens)


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                    seq_lens: torch.Tensor, scale: float, *, max_query_len: int | None = None,
                    max_seq_len: int | None = None,
                    decode_split_size: int | None = None, sliding_window: int = 0,
                    soft_cap: float = 0.0) -> torch.Tensor:
    """Same contract as `kernels.reference.paged_attention`; returns [T, Hq, D] in query.dtype.

    decode_split_size: keys per split-K program for decode rows (power of 2, >= BLOCK_N);
    the split-K path is used when max_seq_len exceeds it.
    """
    assert sliding_window >= 0 and soft_cap >= 0, (sliding_window, soft_cap)
    _check(query, k_cache, v_cache, block_tables, query_start_loc, seq_lens)
    t, hq, d = query.shape
    _, block_size, hkv, _ = k_cache.shape
    b = seq_lens.shape[0]
    out = torch.empty((t, hq, d), dtype=query.dtype, device=query.device)
    if b == 0 or t == 0:
        return out
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())
    split = decode_split_size or DEFAULT_DECODE_SPLIT
    assert split >= BLOCK_N and split & (split - 1) == 0, f"bad decode_split_size {split}"
    num_splits = triton.cdiv(max(max_seq_len, 1), split)
    use_split = num_splits > 1
    group = hq // hkv
    d_pad = max(16, next_pow2(d))
    prec = _dot_precision(k_cache.dtype)
    common = (block_tables, query_start_loc, seq_lens)
    # the kernels take a window always: 2**30 is wider than any int32 context
    window = sliding_window if sliding_window > 0 else 1 << 30
    cap = dict(HAS_SOFT_CAP=soft_cap > 0)

    if max_query_len > 1 or not use_split:
        qh_pad = next_pow2(group)
        block_q = max(1, BLOCK_M // qh_pad)
        if qh_pad * block_q < 16:  # tl.dot needs >= 16 rows
            block_q = 16 // qh_pad
        grid = (b, triton.cdiv(max_query_len, block_q), hkv)
        _varlen_attn_kernel[grid](
            query, k_cache, v_cache, out, *common, scale, window, float(soft_cap),
            query.stride(0), query.stride(1), out.stride(0), out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
            block_size, d, group,
            QH_PAD=qh_pad, BLOCK_Q=block_q, BLOCK_N=BLOCK_N, D_PAD=d_pad,
            SKIP_DECODE=use_split, DOT_PREC=prec, **cap)
    if use_split:
        part_o = torch.empty((b, hq, num_splits, d_pad), dtype=torch.float32, device=query.device)
        part_m = torch.empty((b, hq, num_splits), dtype=torch.float32, device=query.device)
        part_l = torch.empty((b, hq, num_splits), dtype=torch.float32, device=query.device)
        _decode_split_kernel[(b, hkv, num_splits)](
            query, k_cache, v_cache, block_tables, query_start_loc, seq_lens,
            part_o, part_m, part_l, scale, window, float(soft_cap),
            query.stride(0), query.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
            block_size, d, group, hq, num_splits,
            QH_PAD=max(16, next_pow2(group)), SPLIT_SIZE=split, BLOCK_N=BLOCK_N, D_PAD=d_pad,
            DOT_PREC=prec, **cap)
        _decode_reduce_kernel[(b, hq)](
            part_o, part_m, part_l, out, query_start_loc,
            out.stride(0), out.stride(1), d, hq, num_splits,
            S_PAD=next_pow2(num_splits), D_PAD=d_pad)
    return out
