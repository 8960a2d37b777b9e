"""`--quantization int8`: every linear layer's weight quantized once at load (CPU only).

After the checkpoint has loaded in the compute dtype (bf16 or fp32; the default GGUF after its
dequantization), each module that multiplies a weight through `ops.linear` (the decoder's
linear layers and the LM head) gets `packed_weight` = the weight as per-channel int8 panels
(kernels/cpu_ops/int8.py). The float weight then moves to the meta device, as under GGUF blocks:
shape and dtype stay for LoRA and parameter counts, the memory goes. A weight another module
reads too (an LM head tied to the embedding) stays.

What keeps working: biases (added in the GEMM's epilogue, or after the all-reduce of a row-parallel
layer), LoRA adapters (their low-rank update is added in the compute dtype after the int8
product, from the unquantized activations), tensor parallelism (each rank quantizes its own
shard: per-channel scales of a row-parallel shard cover its K slice only). MoE experts are not
linear layers here and stay in the compute dtype. The one-call native decoder (decoder.c) does
not take int8 weights, so steps run layer by layer.
"""
from __future__ import annotations

import logging

import torch
import torch.nn as nn

from kernels import ops
from kernels.cpu_ops import int8

logger = logging.getLogger(__name__)


def quantize_linear_layers(model: nn.Module) -> set:
    """Give every module with a `packed_weight` slot an int8 blob for its weight; returns those
    modules (their process_weights_after_loading, which would pack the float weight, is skipped)."""
    done, before, after = set(), 0, 0
    for module in model.modules():
        w = getattr(module, "weight", None)
        if not (hasattr(module, "packed_weight") and isinstance(w, torch.Tensor) and w.dim() == 2):
            continue
        module.packed_weight = ops.pack_int8_weight(w.data)
        module.gguf_blocks = None
        before += w.numel() * w.element_size()
        after += int8.weight_bytes(module.packed_weight)
        if not getattr(module, "shares_weight", False):
            module.weight = nn.Parameter(torch.empty(w.shape, dtype=w.dtype, device="meta"), requires_grad=False)
        done.add(module)
    logger.info("quantization int8: %d linear layers, %.1f MB of weights -> %.1f MB (GEMM path: %s)",
                len(done), before / 1e6, after / 1e6, int8.isa())
    return done
