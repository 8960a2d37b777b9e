"""Linear layers on the CPU with MKL-packed weights.

`F.linear` on the CPU calls MKL sgemm, which repacks the whole weight matrix into its
blocked layout on every call; with a decode batch of tens of rows that repacking costs as
much as the multiply (measured here: [64, 576] x [576, 3072] at 109 GFLOP/s unpacked,
155 packed). `pack(weight)` packs once at load (`cblas_sgemm_pack`, through torch's own
`mkl::_mkl_reorder_linear_weight`, the op inductor's freezing pass uses) and `linear`
multiplies with `cblas_sgemm_compute`. fp32 only; the packed copy lives beside the weight.

MKL packs B independently of the row count M of A; `linear` passes the call's own M as
`prepack_batch_size`, so every M takes the packed path (tests check M = 1 .. 1024
against F.linear).
"""
from __future__ import annotations

import os
from typing import Optional

import torch
import torch.nn.functional as F


def enabled() -> bool:
    return (os.environ.get("LLMSVC_CPU_KERNELS", "1") not in ("", "0")
            and torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear"))


def pack(weight: torch.Tensor) -> Optional[torch.Tensor]:
    """weight [N, K] fp32 on the CPU -> MKL-packed copy (opaque mkldnn tensor), or None
    when packing does not apply (other dtype or device, MKL missing, disabled by env)."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.dim() != 2 or not enabled():
        return None
    return torch.ops.mkl._mkl_reorder_linear_weight(weight.contiguous(), 64)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
           packed: torch.Tensor) -> torch.Tensor:
    """x: [M, K] (or [..., K]) -> [M, N]; same result as F.linear(x, weight, bias) up to
    summation order."""
    m = x.numel() // x.shape[-1]
    if m == 0:
        return F.linear(x, weight, bias)
    return torch.ops.mkl._mkl_linear(x, packed, weight, bias, m)
