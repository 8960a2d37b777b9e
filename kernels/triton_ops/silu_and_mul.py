"""SiLU-and-mul: out[t, i] = silu(x[t, i]) * x[t, d + i]."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_ops._utils import check_float, check_last_contiguous


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, d, BLOCK: tl.constexpr):
    # x: [T, 2d] (gate | up); out: [T, d]; grid (T, cdiv(d, BLOCK))
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    g = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2d] -> [T, d] in x.dtype."""
    assert x.dim() == 2 and x.shape[1] % 2 == 0, f"x must be [T, 2d], got {tuple(x.shape)}"
    check_float("x", x)
    check_last_contiguous("x", x)
    t, d = x.shape[0], x.shape[1] // 2
    out = torch.empty((t, d), dtype=x.dtype, device=x.device)
    if t == 0 or d == 0:
        return out
    block = 1024
    _silu_and_mul_kernel[(t, triton.cdiv(d, block))](x, out, x.stride(0), out.stride(0), d, BLOCK=block)
    return out
