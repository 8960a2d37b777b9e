"""A layer that may multiply GGUF blocks instead of its fp32 weight (`--quantization gguf`).

llmsvc/models/gguf_blocks.py hands the blocks over after the checkpoint has loaded; the layer
keeps them only until `packed_weight` is made from them (kernels/cpu_ops/gemm.c's int8 panels).
"""
from __future__ import annotations

import torch

from kernels import ops

BLOCK = 32  # weights per scale and offset


class GGUFBlocksMixin:
    """For layers with `weight` [N, K] and `weight_loader(param, loaded, shard_id)`."""

    # this rank's (q [N, K] int8, scale [N, K / 32] fp32, offset [N, K / 32] fp32), W = scale * q + offset
    gguf_blocks: tuple | None = None

    def load_gguf_blocks(self, shard_id, qweight: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> None:
        """Copy this rank's share of one checkpoint tensor's blocks (the whole fused weight, or
        shard `shard_id` of it) as the weight loader copies the fp32 tensor. Raises ValueError
        when this rank's inputs do not fall on whole blocks."""
        n, k = self.weight.shape
        if k % BLOCK:
            raise ValueError(f"{k} input features per rank split GGUF blocks of {BLOCK}")
        if self.gguf_blocks is None:
            self.gguf_blocks = (torch.zeros(n, k, dtype=torch.int8), torch.zeros(n, k // BLOCK),
                                torch.zeros(n, k // BLOCK))
        for dst, src in zip(self.gguf_blocks, (qweight, scale, offset)):
            self.weight_loader(dst, src, shard_id)

    def pack_weight(self):
        """The packed weight for ops.linear: the GGUF blocks where they were loaded and the CPU
        GEMM takes them, else the fp32 (or bf16) weight packed as usual; drops the blocks."""
        blocks, self.gguf_blocks = self.gguf_blocks, None
        packed = None if blocks is None else ops.pack_gguf_blocks(*blocks)
        return packed if packed is not None else ops.pack_linear_weight(self.weight.data)
