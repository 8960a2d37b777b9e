"""Linear layers on the CPU with pre-packed weights.

`F.linear` on the CPU repacks the whole weight matrix into the GEMM library's blocked
layout on every call; with a decode batch of tens of rows that repacking costs about as
much as the multiply. `pack(weight)` packs once at load, through the ops torch's inductor
uses for frozen weights, and `linear` multiplies the packed copy:

  fp32  MKL `cblas_sgemm_pack` / `cblas_sgemm_compute` (`mkl::_mkl_reorder_linear_weight`,
        `mkl::_mkl_linear`); [64, 576] x [576, 3072]: 109 -> 155 GFLOP/s measured here
  bf16  oneDNN (`mkldnn::_reorder_linear_weight`, `mkldnn::_linear_pointwise`);
        the same shape: 273 -> 432 GFLOP/s

Both pack B independently of the row count M of the input: fp32 passes the call's own M as
`prepack_batch_size` so every M takes the packed path; the tests check M = 1 .. 1024
against F.linear. The packed copy lives beside the original weight (the embedding and
checkpoint-shaped code keep using that).
"""
from __future__ import annotations

import os
from typing import Optional

import torch
import torch.nn.functional as F


def enabled() -> bool:
    return os.environ.get("LLMSVC_CPU_KERNELS", "1") not in ("", "0")


def _fp32_ok() -> bool:
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")


def _bf16_ok() -> bool:
    return (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


# resolved overloads (None where the library is missing): the per-layer call skips torch.ops' lookup
_mkl_linear = torch.ops.mkl._mkl_linear.default if _fp32_ok() else None
_linear_pointwise = torch.ops.mkldnn._linear_pointwise.default if _bf16_ok() else None


def pack(weight: torch.Tensor) -> Optional[torch.Tensor]:
    """weight [N, K] fp32 or bf16 on the CPU -> packed copy (opaque), or None when packing
    does not apply (other dtype or device, library missing, LLMSVC_CPU_KERNELS=0)."""
    if weight.device.type != "cpu" or weight.dim() != 2 or not enabled():
        return None
    if weight.dtype == torch.float32 and _mkl_linear is not None:
        return torch.ops.mkl._mkl_reorder_linear_weight(weight.contiguous(), 64)
    if weight.dtype == torch.bfloat16 and _linear_pointwise is not None:
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 64)
    return None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
           packed: torch.Tensor) -> torch.Tensor:
    """x: [M, K] (or [..., K]) -> [M, N]; F.linear(x, weight, bias) up to summation order."""
    m = x.numel() // x.shape[-1]
    dt = weight.dtype
    if m == 0 or x.dtype != dt:
        return F.linear(x, weight, bias)
    if dt == torch.float32:
        return _mkl_linear(x, packed, weight, bias, m)
    return _linear_pointwise(x, packed, bias, "none", [], "")
