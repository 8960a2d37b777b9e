"""SiLU-and-mul over kernels.ops (the gated MLP activation)."""
from __future__ import annotations

import torch
import torch.nn as nn

from kernels import ops


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, 2 * d] laid out (gate | up) -> silu(gate) * up: [T, d]
        return ops.silu_and_mul(x)
