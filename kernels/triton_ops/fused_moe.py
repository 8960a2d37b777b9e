"""Fused mixture-of-experts MLP: two grouped GEMMs over the (token, expert) pairs sorted by expert.

Pairs p = t * k + j (token t's j-th expert) are sorted by expert and each expert's run is
padded to a multiple of BLOCK_M (`align_pairs`), so every tile of BLOCK_M sorted rows belongs
to one expert. One program computes a [BLOCK_M, BLOCK_N] tile of that expert's GEMM, gathering
its A rows by pair index:
  GEMM 1: inter[p, :2I] = x[p // k] @ w13[e].T       (A row = token)
  SiLU-and-mul:  act[p, :I]                           (the existing kernel)
  GEMM 2: y[p, :H] = topk_weight[p] * act[p] @ w2[e].T  (A row = pair), fp32
and out[t] = sum_j y[t * k + j]. Nothing is read on the host: the grid is the worst-case
number of tiles, min(P, cdiv(P, BLOCK_M) + E), and tiles past the last expert's exit at once.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_ops import silu_and_mul as _act
from kernels.triton_ops._utils import check_float, check_same_device

BLOCK_N = 64
BLOCK_K = 32


@triton.jit(do_not_specialize=["num_pairs"])
def _moe_gemm_kernel(a_ptr, b_ptr, c_ptr, w_ptr, pair_ptr, tile_expert_ptr, num_pairs, n_out, k_in,
                     a_row_div, stride_am, stride_be, stride_bn, stride_cm,
                     MUL_WEIGHT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, DOT_PREC: tl.constexpr):
    # a: [rows, K] (row of pair p: p // a_row_div); b: [E, N, K]; c: [P, N]; w: [P] fp32
    # pair_ptr: [num_tiles * BLOCK_M] int32 sorted pairs (num_pairs = padding);
    # tile_expert_ptr: [num_tiles] int32 (-1 = unused tile); grid (num_tiles, cdiv(N, BLOCK_N))
    tile = tl.program_id(0)
    expert = tl.load(tile_expert_ptr + tile)
    if expert < 0:
        return
    pair = tl.load(pair_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))  # [BLOCK_M]
    row_ok = pair < num_pairs
    a_row = (pair // a_row_div).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < n_out
    b_base = b_ptr + expert.to(tl.int64) * stride_be + n.to(tl.int64)[None, :] * stride_bn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, k_in, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < k_in
        a = tl.load(a_ptr + a_row[:, None] * stride_am + kk[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0).to(tl.float32)  # [BLOCK_M, BLOCK_K]
        b = tl.load(b_base + kk[:, None], mask=k_ok[:, None] & n_ok[None, :],
                    other=0.0).to(tl.float32)  # [BLOCK_K, BLOCK_N]: w[e, n, k] transposed
        acc += tl.dot(a, b, input_precision=DOT_PREC)
    if MUL_WEIGHT:
        acc = acc * tl.load(w_ptr + pair, mask=row_ok, other=0.0)[:, None]
    c = c_ptr + pair.to(tl.int64)[:, None] * stride_cm + n[None, :]
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


def block_m_for(num_pairs: int) -> int:
    # decode steps route few pairs per expert: small tiles waste less padding
    return 16 if num_pairs <= 256 else 64


def align_pairs(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(pairs [num_tiles * block_m] int32: pair indices sorted by expert, each expert's run
    padded to a tile border with P; tile_expert [num_tiles] int32, -1 past the last used tile).
    num_tiles = min(P, cdiv(P, block_m) + E), an upper bound known without a device sync."""
    flat = topk_ids.reshape(-1)
    p, dev = flat.numel(), flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    tiles = (counts + block_m - 1) // block_m  # [E]
    tile_end = torch.cumsum(tiles, 0)  # [E]
    num_tiles = min(p, triton.cdiv(p, block_m) + num_experts)
    order = torch.argsort(flat, stable=True)  # [P]
    expert = flat[order]
    rank = torch.arange(p, device=dev) - (torch.cumsum(counts, 0) - counts)[expert]  # index within its expert
    dest = (tile_end - tiles)[expert] * block_m + rank
    pairs = torch.full((num_tiles * block_m,), p, dtype=torch.int32, device=dev)
    pairs[dest] = order.to(torch.int32)
    tile_expert = torch.searchsorted(tile_end, torch.arange(num_tiles, device=dev), right=True)
    tile_expert = torch.where(tile_expert < num_experts, tile_expert, -1).to(torch.int32)
    return pairs, tile_expert


def _gemm(a, w, out, weights, pairs, tile_expert, num_pairs, a_row_div, block_m, mul_weight):
    e, n, k = w.shape
    grid = (tile_expert.shape[0], triton.cdiv(n, BLOCK_N))
    prec = "ieee" if w.dtype == torch.float32 else "tf32"  # 16-bit inputs are exact in tf32
    _moe_gemm_kernel[grid](a, w, out, weights, pairs, tile_expert, num_pairs, n, k, a_row_div,
                           a.stride(0), w.stride(0), w.stride(1), out.stride(0),
                           MUL_WEIGHT=mul_weight, BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
                           DOT_PREC=prec, num_warps=4)


def fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
    """hidden [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights [T, k], topk_ids [T, k]
    -> [T, H] in hidden.dtype (see kernels/reference_moe.py)."""
    assert hidden.dim() == 2 and hidden.stride(1) == 1, f"hidden must be [T, H] row-major, {hidden.stride()}"
    t, h = hidden.shape
    e, two_i, h1 = w13.shape
    assert h1 == h and two_i % 2 == 0 and w2.shape == (e, h, two_i // 2), \
        f"w13 {tuple(w13.shape)} / w2 {tuple(w2.shape)} do not fit hidden size {h}"
    assert w13.is_contiguous() and w2.is_contiguous(), "expert weights must be contiguous"
    assert topk_ids.shape == topk_weights.shape and topk_ids.dim() == 2 and topk_ids.shape[0] == t
    assert w13.dtype == w2.dtype == hidden.dtype, f"{hidden.dtype} / {w13.dtype} / {w2.dtype}"
    check_float("hidden", hidden)
    check_same_device(hidden, w13, w2, topk_weights, topk_ids)
    k = topk_ids.shape[1]
    num_pairs = t * k
    if num_pairs == 0:
        return hidden.new_zeros(t, h)
    block_m = block_m_for(num_pairs)
    pairs, tile_expert = align_pairs(topk_ids.long(), e, block_m)
    weights = topk_weights.reshape(-1).float().contiguous()  # [P]
    inter = torch.empty((num_pairs, two_i), dtype=hidden.dtype, device=hidden.device)
    _gemm(hidden, w13, inter, weights, pairs, tile_expert, num_pairs, k, block_m, False)
    act = _act.silu_and_mul(inter)  # [P, I]
    y = torch.empty((num_pairs, h), dtype=torch.float32, device=hidden.device)
    _gemm(act, w2, y, weights, pairs, tile_expert, num_pairs, 1, block_m, True)
    return y.view(t, k, h).sum(dim=1).to(hidden.dtype)
