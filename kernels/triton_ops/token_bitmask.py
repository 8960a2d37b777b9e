"""Structured output: logits of tokens a grammar forbids -> -inf, from a packed bitmask."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_ops._utils import check_float, check_last_contiguous, check_same_device


@triton.jit
def _apply_token_bitmask_kernel(logits_ptr, bitmask_ptr, rows_ptr, stride_l, stride_b, V, W,
                                BLOCK: tl.constexpr):
    # logits: [S, V]; bitmask: [R, W] int32; rows: [R] int64; grid (R, cdiv(V, BLOCK))
    r = tl.program_id(0).to(tl.int64)
    row = tl.load(rows_ptr + r)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_v = cols < V
    word = cols // 32
    # words past W stay 0: a token beyond the mask's width is forbidden
    words = tl.load(bitmask_ptr + r * stride_b + word, mask=in_v & (word < W), other=0)
    allowed = ((words >> (cols % 32)) & 1) != 0
    tl.store(logits_ptr + row * stride_l + cols, float("-inf"), mask=in_v & (allowed == 0))


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """In place; same contract as kernels.reference.apply_token_bitmask_."""
    assert logits.dim() == 2 and bitmask.dim() == 2, (logits.shape, bitmask.shape)
    assert rows.dim() == 1 and rows.shape[0] == bitmask.shape[0], (rows.shape, bitmask.shape)
    assert bitmask.dtype == torch.int32 and rows.dtype == torch.int64, (bitmask.dtype, rows.dtype)
    check_float("logits", logits)
    check_last_contiguous("logits", logits)
    check_last_contiguous("bitmask", bitmask)
    check_same_device(logits, bitmask, rows)
    R, W = bitmask.shape
    V = logits.shape[1]
    if R == 0 or V == 0:
        return
    block = 1024
    _apply_token_bitmask_kernel[(R, triton.cdiv(V, block))](
        logits, bitmask, rows, logits.stride(0), bitmask.stride(0), V, W, BLOCK=block)
