"""LoRA's low-rank update, per token: y[t] += B[s_t] @ (A[s_t] @ x[t]) for s_t = token_slots[t] >= 0.

Two kernels, one program per (token, block of outputs), as punica's BGMV does for decode: the
shrink h[t] = A[s_t] @ x[t] ([T, R], fp32 scratch) and the expand y[t] += B[s_t] @ h[t]. A token
reads its adapter's rows itself, so any mix of adapters (and base-model tokens, slot -1, which
are left untouched) is one launch each, with no host-side grouping: the shapes depend on T only,
which is what a captured CUDA graph needs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_ops._utils import check_float, check_last_contiguous


@triton.jit
def _lora_shrink_kernel(x_ptr, a_ptr, slot_ptr, h_ptr, stride_x, stride_as, stride_ar, stride_h, K, R,
                        BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    # x: [T, K]; a: [S, R, K]; h: [T, R] fp32; grid (T, cdiv(R, BLOCK_R))
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    s = tl.maximum(slot, 0)
    k_end = tl.where(slot >= 0, K, 0)  # a base-model token (slot -1) reads nothing
    rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        xk = tl.load(x_ptr + t * stride_x + ks, mask=ks < k_end, other=0.0).to(tl.float32)
        a = tl.load(a_ptr + s * stride_as + rows[:, None].to(tl.int64) * stride_ar + ks[None, :],
                    mask=(rows[:, None] < R) & (ks[None, :] < k_end), other=0.0).to(tl.float32)
        acc += tl.sum(a * xk[None, :], axis=1)
    tl.store(h_ptr + t * stride_h + rows, acc, mask=rows < R)


@triton.jit
def _lora_expand_kernel(h_ptr, b_ptr, slot_ptr, y_ptr, stride_h, stride_bs, stride_bn, stride_y, R, N,
                        BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    # h: [T, R] fp32; b: [S, N, R]; y: [T, N] (updated in place); grid (T, cdiv(N, BLOCK_N))
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    s = tl.maximum(slot, 0)
    n_end = tl.where(slot >= 0, N, 0)  # a base-model token (slot -1): nothing read or written
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        rs = r0 + tl.arange(0, BLOCK_R)
        hr = tl.load(h_ptr + t * stride_h + rs, mask=rs < R, other=0.0)
        b = tl.load(b_ptr + s * stride_bs + cols[:, None].to(tl.int64) * stride_bn + rs[None, :],
                    mask=(cols[:, None] < n_end) & (rs[None, :] < R), other=0.0).to(tl.float32)
        acc += tl.sum(b * hr[None, :], axis=1)
    mask = cols < n_end
    y = tl.load(y_ptr + t * stride_y + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + t * stride_y + cols, (y + acc).to(y_ptr.dtype.element_ty), mask=mask)


def lora_add_(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
              token_slots: torch.Tensor) -> None:
    """y [T, N] += per token t with token_slots[t] >= 0: (x[t] @ lora_a[s].T) @ lora_b[s].T.
    x [T, K]; lora_a [S, R, K], lora_b [S, N, R] (contiguous); token_slots [T] int32 / int64."""
    t, k = x.shape
    s, r, k2 = lora_a.shape
    n = lora_b.shape[1]
    assert k2 == k and lora_b.shape == (s, n, r) and y.shape == (t, n) and token_slots.shape == (t,), \
        f"shapes: x {tuple(x.shape)}, a {tuple(lora_a.shape)}, b {tuple(lora_b.shape)}, y {tuple(y.shape)}"
    for name, v in (("x", x), ("y", y), ("lora_a", lora_a), ("lora_b", lora_b)):
        check_float(name, v)
        check_last_contiguous(name, v)
    assert lora_a.is_contiguous() and lora_b.is_contiguous(), "lora_a and lora_b must be contiguous"
    if t == 0 or r == 0 or n == 0:
        return
    h = torch.empty((t, r), dtype=torch.float32, device=x.device)
    block_r = min(64, triton.next_power_of_2(r))
    _lora_shrink_kernel[(t, triton.cdiv(r, block_r))](
        x, lora_a, token_slots, h, x.stride(0), lora_a.stride(0), lora_a.stride(1), h.stride(0), k, r,
        BLOCK_R=block_r, BLOCK_K=128)
    block_n = 128
    _lora_expand_kernel[(t, triton.cdiv(n, block_n))](
        h, lora_b, token_slots, y, h.stride(0), lora_b.stride(0), lora_b.stride(1), y.stride(0), r, n,
        BLOCK_N=block_n, BLOCK_R=block_r)
