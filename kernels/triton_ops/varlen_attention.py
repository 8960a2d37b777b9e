"""Varlen causal attention over the paged KV cache (prefill, chunked prefill, decode).

One program per (sequence, tile of BLOCK_Q query tokens, kv head). The query heads that
share a kv head (GQA) are packed into the tile's rows: row r is query token r // QH_PAD of
the tile and query head kv_head * group + r % QH_PAD, so a decode step still fills a
tensor-core tile. Query token j of a sequence with q_len new tokens and context ctx sits at
position ctx - q_len + j and attends to cache positions 0..ctx - q_len + j (bottom-right
aligned causal mask; the cached prefix is fully visible), or with a sliding window to
positions > ctx - q_len + j - window only (the wrapper passes window = 2**30 for none); keys
before the tile's first window are never loaded. HAS_SOFT_CAP: scores s become
soft_cap * tanh(s / soft_cap) before the mask (Gemma's logit softcapping).
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def soft_cap_scores(s, soft_cap):
    # soft_cap * tanh(s / soft_cap), tanh from one exp of a non-positive argument (no overflow)
    x = s / soft_cap
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return soft_cap * tl.where(x < 0, -t, t)


# the block table's width changes from step to step (1 at warm-up): one compiled variant
@triton.jit(do_not_specialize=["stride_bt"])
def _varlen_attn_kernel(q_ptr, kc_ptr, vc_ptr, out_ptr, bt_ptr, qsl_ptr, seq_lens_ptr, scale,
                        window, soft_cap, stride_qt, stride_qh, stride_ot, stride_oh,
                        stride_cb, stride_cs, stride_ch, stride_bt,
                        block_size, head_size, group,
                        QH_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
                        D_PAD: tl.constexpr, SKIP_DECODE: tl.constexpr, DOT_PREC: tl.constexpr,
                        HAS_SOFT_CAP: tl.constexpr):
    # q, out: [T, Hq, D]; k/v cache: [num_blocks, block_size, Hkv, D]; block table: [B, M] int32
    seq = tl.program_id(0)
    q_tile = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    skip = q_tile * BLOCK_Q >= q_len
    if SKIP_DECODE:
        skip = skip | (q_len == 1)  # decode rows are handled by the split-K decode kernel
    if skip:
        return
    ctx = tl.load(seq_lens_ptr + seq)
    prefix = ctx - q_len

    BLOCK_M: tl.constexpr = BLOCK_Q * QH_PAD
    r = tl.arange(0, BLOCK_M)
    tok = q_tile * BLOCK_Q + r // QH_PAD  # [BLOCK_M] query index inside the sequence
    hq = r % QH_PAD
    row_ok = (tok < q_len) & (hq < group)
    head = (kv_head * group + hq).to(tl.int64)
    d = tl.arange(0, D_PAD)
    d_ok = d < head_size
    row_t = (q_start + tok).to(tl.int64)
    q_mask = row_ok[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + row_t[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=q_mask, other=0.0).to(tl.float32)  # [BLOCK_M, D_PAD]
    q_pos = prefix + tok  # [BLOCK_M]

    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    kv_end = tl.minimum(ctx, prefix + (q_tile + 1) * BLOCK_Q)  # last key this tile sees, + 1
    kv_start = tl.maximum(prefix + q_tile * BLOCK_Q - window + 1, 0)  # the tile's first row's window
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    for start in range(kv_start, kv_end, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
        n_ok = n < kv_end
        phys = tl.load(bt_row + n // block_size, mask=n_ok, other=0).to(tl.int64)
        kv_off = phys * stride_cb + (n % block_size) * stride_cs + kv_head * stride_ch  # [BLOCK_N] int64
        kv_mask = n_ok[None, :] & d_ok[:, None]
        k_t = tl.load(kc_ptr + kv_off[None, :] + d[:, None], mask=kv_mask,
                      other=0.0).to(tl.float32)  # [D_PAD, BLOCK_N]
        s = tl.dot(q, k_t, input_precision=DOT_PREC) * scale  # [BLOCK_M, BLOCK_N]
        if HAS_SOFT_CAP:
            s = soft_cap_scores(s, soft_cap)
        visible = (n[None, :] <= q_pos[:, None]) & (n[None, :] > q_pos[:, None] - window) & n_ok[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(vc_ptr + kv_off[:, None] + d[None, :], mask=tl.trans(kv_mask),
                    other=0.0).to(tl.float32)  # [BLOCK_N, D_PAD]
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PREC)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + row_t[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=q_mask)
