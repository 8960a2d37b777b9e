"""RMSNorm and fused residual-add + RMSNorm: one program per token row."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_ops._utils import check_float, check_last_contiguous, check_same_device, next_pow2


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
                     stride_x, stride_r, stride_o, stride_ro,
                     hidden, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    # x, res: [T, hidden] (row strides given); out, res_out: [T, hidden]; w: [hidden]
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        s = (x + r).to(res_out_ptr.dtype.element_ty)  # rounded to the storage dtype, as HF does
        tl.store(res_out_ptr + row * stride_ro + cols, s, mask=mask)
        x = s.to(tl.float32)
    var = tl.sum(x * x, axis=0) / hidden
    rstd = 1.0 / tl.sqrt(var + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = x * rstd * w
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    assert x.dim() == 2, f"x must be [num_tokens, hidden], got {tuple(x.shape)}"
    assert weight.shape == (x.shape[1],), f"weight {tuple(weight.shape)} vs hidden {x.shape[1]}"
    check_float("x", x)
    check_float("weight", weight)
    check_last_contiguous("x", x)
    assert weight.is_contiguous()


def _launch(x, residual, weight, eps, out, res_out):
    t, hidden = x.shape
    if t == 0:
        return
    block = next_pow2(hidden)
    num_warps = 4 if block <= 2048 else 8
    _rms_norm_kernel[(t,)](
        x, residual if residual is not None else x, weight, out,
        res_out if res_out is not None else out,
        x.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0),
        res_out.stride(0) if res_out is not None else 0,
        hidden, eps, HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=num_warps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [T, hidden] -> [T, hidden] in x.dtype (computed in fp32)."""
    _check(x, weight)
    check_same_device(x, weight)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(x, None, weight, eps, out, None)
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual); both new tensors in x.dtype."""
    _check(x, weight)
    assert residual.shape == x.shape, f"residual {tuple(residual.shape)} vs x {tuple(x.shape)}"
    check_float("residual", residual)
    check_last_contiguous("residual", residual)
    check_same_device(x, residual, weight)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    res_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(x, residual, weight, eps, out, res_out)
    return out, res_out
