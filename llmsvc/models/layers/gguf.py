"""A layer that may multiply GGUF blocks instead of its fp32 weight (`--quantization gguf`).

llmsvc/models/gguf_blocks.py hands the blocks over after the checkpoint has loaded; the layer
keeps them only until `packed_weight` is made from them (kernels/cpu_ops/gemm.c's int8 panels).
Then its fp32 weight, which nothing multiplies any more, becomes a tensor on the meta device: the
shape and dtype stay (LoRA, parameter counts read them), the memory goes. A weight another module
uses too (an LM head tied to the embedding) stays.
"""
from __future__ import annotations

import torch

from kernels import ops


class GGUFBlocksMixin:
    """For layers with `weight` [N, K] and `weight_loader(param, loaded, shard_id)`."""

    # this rank's (q [N, K] int8, scale [N, K / bs] fp32, offset [N, K / bs] fp32), W = scale * q
    # + offset per bs (16 or 32) weights
    gguf_blocks: tuple | None = None
    # set where `weight` is another module's too (ParallelLMHead.tie_weights): it stays
    shares_weight: bool = False

    def load_gguf_blocks(self, shard_id, qweight: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> None:
        """Copy this rank's share of one checkpoint tensor's blocks (the whole fused weight, or
        shard `shard_id` of it; every part in blocks of the same size) as the weight loader
        copies the fp32 tensor. Raises ValueError when this rank's inputs do not fall on whole
        blocks."""
        n, k = self.weight.shape
        bs = qweight.shape[1] // scale.shape[1]
        if k % bs:
            raise ValueError(f"{k} input features per rank split GGUF blocks of {bs}")
        if self.gguf_blocks is None:
            self.gguf_blocks = (torch.zeros(n, k, dtype=torch.int8), torch.zeros(n, k // bs), torch.zeros(n, k // bs))
        for dst, src in zip(self.gguf_blocks, (qweight, scale, offset)):
            self.weight_loader(dst, src, shard_id)

    def pack_weight(self):
        """The packed weight for ops.linear: the GGUF blocks where they were loaded and the CPU
        GEMM takes them (the fp32 weight then moves to the meta device unless shared), else the
        fp32 (or bf16) weight packed as usual; drops the blocks."""
        blocks, self.gguf_blocks = self.gguf_blocks, None
        packed = None if blocks is None else ops.pack_gguf_blocks(*blocks)
        if packed is None:
            return ops.pack_linear_weight(self.weight.data)
        if not self.shares_weight:
            w = self.weight
            self.weight = torch.nn.Parameter(torch.empty(w.shape, dtype=w.dtype, device="meta"), requires_grad=False)
        return packed
