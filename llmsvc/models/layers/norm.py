"""RMSNorm over kernels.ops: plain, or fused with the residual add."""
from __future__ import annotations

import torch
import torch.nn as nn

from kernels import ops


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6, params_dtype: torch.dtype | None = None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=params_dtype or torch.get_default_dtype()),
                                   requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """x: [T, hidden]. Without residual: rms_norm(x). With residual: returns
        (rms_norm(x + residual), x + residual), the new residual stream."""
        if residual is None:
            return ops.rms_norm(x, self.weight, self.eps)
        return ops.fused_add_rms_norm(x, residual, self.weight, self.eps)
