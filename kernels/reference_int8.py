"""Torch reference of the int8 linear layer (`--quantization int8`): the CPU fallback where the
native GEMM (kernels/cpu_ops/gemm_int8*.c) is not built, and the tests' ground truth.

Weights: per output channel, symmetric: q_w[n, k] = round(W[n, k] / s_w[n]) in [-qmax, qmax],
s_w[n] = r max_k |W[n, k]| / qmax with the clipping ratio r (1 to 0.6) that leaves the row the
least squared error (0 for an all-zero row); qmax is 127, or 64 for a path whose int16 pair
sums hold no more (kernels/cpu_ops/int8.weight_qmax).
Activations: per token (row of x), symmetric, at run time, unclipped:
s_a[m] = max_k |x[m, k]| / 127. Both ranges stop at 127 (not -128), so a product is at most
127 * 127 in magnitude on every ISA path and the sign can be moved between operands.

Smoothing (SmoothQuant): a weight may come with per-input-channel factors f[k] > 0 moved from
the activations into the weight: W[n, k] f[k] is quantized, and x[m, k] / f[k] (x times the stored
1 / f, in fp32) is what gets quantized per row, so that a few input channels with outlying
magnitudes do not take a row's whole int8 range. Without smoothing 1 / f = 1.

y[m, n] = fp32(sum_k q_a[m, k] q_w[n, k]) * s_a[m] * s_w[n] + bias[n], rounded once to x's
dtype. The integer sum is exact here (float64 holds any K below 2^39) and in the native
kernels (int32), so both agree on it bit for bit; only the fp32 epilogue may differ in the
last place (fused multiply-add, the order of the two scale multiplies).
"""
from __future__ import annotations

from typing import Optional

import torch

QMAX = 127
# a weight row's scale is searched among these shares of its largest magnitude (quantize_weight)
CLIP_RATIOS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] float -> (q [M, K] int8, scale [M] fp32), per row, symmetric.

    The native kernels compute exactly this in fp32: inv = 127 / amax (one division), then
    round-half-even(x * inv) (not x / scale, which rounds differently)."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1)
    # a true division: `127 / tensor` in torch is reciprocal() * 127, another rounding
    inv = torch.where(amax > 0, torch.full_like(amax, QMAX) / amax, torch.zeros_like(amax))
    q = torch.round(xf * inv.unsqueeze(-1)).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, amax / QMAX


def quantize_weight(weight: torch.Tensor, qmax: int = QMAX) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] (any float dtype, the checkpoint's) -> (q [N, K] int8, scale [N] fp32): per
    output channel, symmetric, q = round(W / s) clamped to +-qmax, with s the one of
    CLIP_RATIOS x max_k |W[n, k]| / qmax that leaves the row the least squared error. A row's few
    largest weights then saturate where a finer grid serves the rest better."""
    wf = weight.float()
    amax = wf.abs().amax(dim=-1, keepdim=True)
    amax1 = torch.where(amax > 0, amax, torch.ones_like(amax))  # an all-zero row: q = 0 at any scale

    def sq_error(s: torch.Tensor) -> torch.Tensor:
        return ((torch.round(wf / s).clamp_(-qmax, qmax) * s - wf) ** 2).sum(-1, keepdim=True)

    scale = amax1 / qmax
    best = sq_error(scale)
    for ratio in CLIP_RATIOS[1:]:
        s = amax1 * ratio / qmax
        err = sq_error(s)
        scale, best = torch.where(err < best, s, scale), torch.minimum(err, best)
    q = torch.round(wf / scale).clamp_(-qmax, qmax).to(torch.int8)
    return q, torch.where(amax > 0, scale, torch.zeros_like(scale)).squeeze(-1)


def smoothing(act_amax: torch.Tensor, weight: torch.Tensor, alpha: float = 0.5) -> torch.Tensor:
    """SmoothQuant's per-input-channel factors f [K] fp32 for weight [N, K], from the largest
    magnitude each input channel took on calibration data (act_amax [K]):
    f = act_amax^alpha / max_n |W[n, k]|^(1 - alpha), so that channel's activation and weight
    ranges meet halfway (alpha 0.5); channels never seen or all-zero get 1."""
    wmax = weight.float().abs().amax(dim=0)
    f = act_amax.float().clamp(min=1e-5).pow(alpha) / wmax.clamp(min=1e-5).pow(1 - alpha)
    return torch.where((act_amax > 0) & (wmax > 0), f, torch.ones_like(f))


def int8_linear(x: torch.Tensor, qweight: torch.Tensor, wscale: torch.Tensor,
                bias: Optional[torch.Tensor] = None, smooth_inv: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [..., K] fp32 or bf16 @ (qweight [N, K] int8 * wscale [N])^T + bias [N] -> [..., N] in
    x's dtype, with x (times smooth_inv [K] fp32, 1 / f, if given) quantized per row first (the
    module docstring has the formula)."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    if smooth_inv is not None:
        x2 = x2.float() * smooth_inv
    qa, sa = quantize_rows(x2)
    acc = (qa.double() @ qweight.double().t()).float()  # exact integer sums, rounded to fp32 once
    y = acc * sa.unsqueeze(-1) * wscale.unsqueeze(0)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).view(*x.shape[:-1], qweight.shape[0])
