"""`--quantization int8`: the decoder's linear weights quantized once at load (CPU only).

After the checkpoint has loaded in the compute dtype (bf16 or fp32; the default GGUF after its
dequantization) and every layer has packed its float weight as usual:

1. Calibration: the model prefills CALIB_SEQS x CALIB_LEN deterministic pseudo-random token ids
   (seed CALIB_SEED) on its float weights, and each linear layer records the largest magnitude
   of each of its input channels.
2. Each linear layer (`LinearBase`: q/k/v, o, gate/up, down) gets `packed_weight` = its weight
   times SmoothQuant's per-input-channel factors f (reference_int8.smoothing, alpha 0.5),
   quantized per output channel (kernels/cpu_ops/int8.py); at run time each activation row is
   divided by f and quantized per token. Small Llama-family models carry a few input channels
   of outlying magnitude; without f they take each token's int8 range. SmolLM2-135M, bf16's
   greedy continuations of W1's first 16 prompts teacher-forced (2048 positions; bf16 itself
   ranks 99.2% of them first, prefill against decode rounding): KL to bf16 0.0114 -> 0.0046,
   top-1 agreement 97.9% -> 98.7% with f; alpha 0.3 / 0.65 / 0.8: KL 0.0081 / 0.0068 / 0.0096.
   The model's own greedy text instead of random ids (KL 0.0045), or 16 sequences instead of 8
   (0.0053), calibrates no better.
   The float weight then moves to the meta device, as under GGUF blocks: shape and dtype stay
   for LoRA and parameter counts, the memory goes.

The LM head keeps its float weight and GEMM: quantizing it too cost another 6 points of top-1
agreement in an earlier measurement on random-token positions (its 49k logits are what greedy
decoding compares), for ~20% of the weight bytes.

Measured and not taken (same 2048 positions; KL / top-1): of the 0.0046, weights alone (float
activations) account for 0.0016 / 99.1%; by projection, int8 in q/k/v only 0.0018, o only
0.0009, gate/up only 0.0013, down only 0.0031. Keeping down_proj in bf16 (0.0027 / 98.9%) gives
up its int8 GEMM, 1.5x bf16's speed at one row. LLM.int8()-style float outlier channels (the
1 / 2 / 4 / 8 / 16 input channels of largest calibrated magnitude per layer zeroed out of the
int8 product and multiplied in float beside it): KL 0.0037 / 0.0036 / 0.0032 / 0.0028 / 0.0026,
top-1 98.6% / 98.6% / 98.8% / 98.5% / 98.4%, no gain in top-1 beyond the sample's noise
(0.3 points = 6 positions), while the extra gather, small GEMM and add in torch roughly
doubled a one-row int8 linear on the AVX2 box (4 channels: +47-84 us a layer). On all 64
prompts x 128 tokens (python -m benchmarks.int8_quality) int8 ranks bf16's token first at
98.1% of the positions with 8-bit weights (the VNNI and AMX paths, LLMSVC_INT8_ISA=avx2) and
98.0% with the +-64 weights of AVX2's default path (bf16 itself 98.9%); on 24 natural chat
questions (--prompts chat) at 92.5% and 91.2% (bf16 itself 95.8%). docs/cpu-kernels.md has the
tables.

What keeps working: biases (added in the GEMM's epilogue, or after the all-reduce of a row-parallel
layer), LoRA adapters (their low-rank update is added in the compute dtype after the int8
product, from the unsmoothed activations), tensor parallelism (every rank calibrates on the same
ids in lockstep and quantizes its own shard; a row-parallel shard's scales cover its K slice).
MoE experts are not linear layers here and stay in the compute dtype. The one-call native
decoder (decoder.c) multiplies the int8 blobs through the same GEMM as the per-op layers, bit for
bit, and with no float panel's row limit takes steps of any size.
"""
from __future__ import annotations

import logging

import torch
import torch.nn as nn

from kernels import ops
from kernels import reference_int8
from kernels.cpu_ops import int8
from llmsvc.models.layers.attention import AttentionMetadata
from llmsvc.models.layers.linear import LinearBase

logger = logging.getLogger(__name__)

CALIB_SEQS, CALIB_LEN, CALIB_SEED = 8, 128, 1234  # CALIB_LEN: a multiple of the block size
_BLOCK = 16
SMOOTH_ALPHA = 0.5


@torch.no_grad()
def calibrate(model: nn.Module, layers: list[nn.Module]) -> dict[nn.Module, torch.Tensor]:
    """{layer: [K] fp32 largest |input| per channel} over one prefill of the calibration ids."""
    from llmsvc.models.llama import kv_cache_spec

    cfg = model.config
    num_layers, kv_heads, head_dim = kv_cache_spec(cfg)
    dtype = getattr(model, "dtype", torch.float32)
    s, n = CALIB_SEQS, CALIB_LEN
    per_seq = n // _BLOCK
    caches = [(torch.zeros(s * per_seq, _BLOCK, kv_heads, head_dim, dtype=dtype),
               torch.zeros(s * per_seq, _BLOCK, kv_heads, head_dim, dtype=dtype)) for _ in range(num_layers)]
    g = torch.Generator().manual_seed(CALIB_SEED)
    ids = torch.randint(0, cfg.vocab_size, (s * n,), generator=g)
    meta = AttentionMetadata(  # sequence i: blocks i * per_seq ..., so its slots are i * n + position
        slot_mapping=torch.arange(s * n), block_tables=torch.arange(s * per_seq, dtype=torch.int32).view(s, per_seq),
        query_start_loc=torch.arange(0, s * n + 1, n, dtype=torch.int32),
        seq_lens=torch.full((s,), n, dtype=torch.int32), max_query_len=n, max_seq_len=n)
    amax: dict[nn.Module, torch.Tensor] = {}

    def record(module, args, _out):
        a = args[0].detach().reshape(-1, args[0].shape[-1]).float().abs().amax(dim=0)
        amax[module] = a if module not in amax else torch.maximum(amax[module], a)

    hooks = [m.register_forward_hook(record) for m in layers]
    try:
        model(ids, torch.arange(n).repeat(s), meta, caches)
    finally:
        for h in hooks:
            h.remove()
    return amax


def quantize_linear_layers(model: nn.Module) -> list[nn.Module]:
    """Calibrate, then give every LinearBase an int8 blob for its smoothed weight (module
    docstring); returns those layers."""
    layers = [m for m in model.modules() if isinstance(m, LinearBase) and m.weight.dim() == 2]
    for m in model.modules():  # the float weights' per-layer plan must not outlive them
        if hasattr(m, "_native_planned"):
            m._native_plan, m._native_planned = None, True
    amax = calibrate(model, layers)
    missing = sum(m not in amax for m in layers)
    if missing:  # a layer the calibration prefill did not run: quantized without smoothing
        logger.warning("quantization int8: %d of %d linear layers saw no calibration input", missing, len(layers))
    before = after = 0
    for module in layers:
        w = module.weight
        f = reference_int8.smoothing(amax[module], w.data, SMOOTH_ALPHA) if module in amax else None
        module.packed_weight = ops.pack_int8_weight(w.data, f)
        before += w.numel() * w.element_size()
        after += int8.weight_bytes(module.packed_weight)
        if not getattr(module, "shares_weight", False):
            module.weight = nn.Parameter(torch.empty(w.shape, dtype=w.dtype, device="meta"), requires_grad=False)
    for m in model.modules():  # planned again at the next step: the int8 blobs take the per-op path
        if hasattr(m, "_native_planned"):
            m._native_plan, m._native_planned = None, False
    logger.info("quantization int8: %d linear layers, %.1f MB of weights -> %.1f MB, smoothed over %d "
                "calibration tokens (GEMM path: %s)", len(layers), before / 1e6, after / 1e6,
                CALIB_SEQS * CALIB_LEN, int8.isa())
    return layers
