"""Split-K paged decode attention (one query token per sequence) and its reduction.

Phase 1: one program per (sequence, kv head, split of SPLIT_SIZE keys) computes, for the
group of query heads sharing the kv head, the unnormalised partial output, the running max
and the softmax denominator. Phase 2: one program per (sequence, query head) merges the
splits. Sequences whose q_len != 1 are skipped (the varlen kernel owns them). Keys before
ctx - window (sliding window; 2**30 for none) are never loaded; HAS_SOFT_CAP as in the varlen
kernel.
"""
from __future__ import annotations

import triton
import triton.language as tl

from kernels.triton_ops.varlen_attention import soft_cap_scores


# the block table's width and the split count change from step to step: one compiled variant
@triton.jit(do_not_specialize=["stride_bt", "num_splits"])
def _decode_split_kernel(q_ptr, kc_ptr, vc_ptr, bt_ptr, qsl_ptr, seq_lens_ptr,
                         part_o_ptr, part_m_ptr, part_l_ptr, scale, window, soft_cap,
                         stride_qt, stride_qh, stride_cb, stride_cs, stride_ch, stride_bt,
                         block_size, head_size, group, num_q_heads, num_splits,
                         QH_PAD: tl.constexpr, SPLIT_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                         D_PAD: tl.constexpr, DOT_PREC: tl.constexpr, HAS_SOFT_CAP: tl.constexpr):
    # part_o: [B, Hq, num_splits, D_PAD] fp32; part_m, part_l: [B, Hq, num_splits] fp32
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    if q_len != 1:
        return
    ctx = tl.load(seq_lens_ptr + seq)
    r = tl.arange(0, QH_PAD)
    r_ok = r < group
    head = (kv_head * group + r).to(tl.int64)
    d = tl.arange(0, D_PAD)
    d_ok = d < head_size
    q = tl.load(q_ptr + q_start.to(tl.int64) * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=r_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)  # [QH_PAD, D_PAD]

    m_i = tl.full([QH_PAD], -1.0e30, tl.float32)
    l_i = tl.zeros([QH_PAD], tl.float32)
    acc = tl.zeros([QH_PAD, D_PAD], tl.float32)
    lo = split * SPLIT_SIZE
    hi = tl.minimum(ctx, lo + SPLIT_SIZE)
    win_lo = ctx - window  # first key in the window
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    for start in range(tl.maximum(lo, win_lo), hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = (n < hi) & (n >= win_lo)
        phys = tl.load(bt_row + n // block_size, mask=n_ok, other=0).to(tl.int64)
        kv_off = phys * stride_cb + (n % block_size) * stride_cs + kv_head * stride_ch  # int64
        kv_mask = n_ok[None, :] & d_ok[:, None]
        k_t = tl.load(kc_ptr + kv_off[None, :] + d[:, None], mask=kv_mask,
                      other=0.0).to(tl.float32)  # [D_PAD, BLOCK_N]
        s = tl.dot(q, k_t, input_precision=DOT_PREC) * scale  # [QH_PAD, BLOCK_N]
        if HAS_SOFT_CAP:
            s = soft_cap_scores(s, soft_cap)
        s = tl.where(n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(vc_ptr + kv_off[:, None] + d[None, :], mask=tl.trans(kv_mask),
                    other=0.0).to(tl.float32)  # [BLOCK_N, D_PAD]
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PREC)
        m_i = m_new
    ml_off = (seq.to(tl.int64) * num_q_heads + head) * num_splits + split  # [QH_PAD]
    tl.store(part_m_ptr + ml_off, m_i, mask=r_ok)
    tl.store(part_l_ptr + ml_off, l_i, mask=r_ok)
    tl.store(part_o_ptr + ml_off[:, None] * D_PAD + d[None, :], acc, mask=r_ok[:, None])


@triton.jit(do_not_specialize=["num_splits"])
def _decode_reduce_kernel(part_o_ptr, part_m_ptr, part_l_ptr, out_ptr, qsl_ptr,
                          stride_ot, stride_oh, head_size, num_q_heads, num_splits,
                          S_PAD: tl.constexpr, D_PAD: tl.constexpr):
    # merges the num_splits partial results of one (sequence, query head) into out[row, head, :]
    seq = tl.program_id(0)
    head = tl.program_id(1)
    q_start = tl.load(qsl_ptr + seq)
    if tl.load(qsl_ptr + seq + 1) - q_start != 1:
        return
    sp = tl.arange(0, S_PAD)
    sp_ok = sp < num_splits
    base = (seq.to(tl.int64) * num_q_heads + head) * num_splits
    m = tl.load(part_m_ptr + base + sp, mask=sp_ok, other=-1.0e30)
    l = tl.load(part_l_ptr + base + sp, mask=sp_ok, other=0.0)
    d = tl.arange(0, D_PAD)
    o = tl.load(part_o_ptr + (base + sp)[:, None] * D_PAD + d[None, :], mask=sp_ok[:, None],
                other=0.0)  # [S_PAD, D_PAD]
    w = tl.exp(m - tl.max(m, axis=0))  # [S_PAD]
    denom = tl.sum(w * l, axis=0)
    out = tl.sum(w[:, None] * o, axis=0) / tl.where(denom > 0, denom, 1.0)
    tl.store(out_ptr + q_start.to(tl.int64) * stride_ot + head * stride_oh + d,
             out.to(out_ptr.dtype.element_ty), mask=d < head_size)
