"""Torch reference of the mixture-of-experts ops: the CPU path and the Triton kernel's ground truth.

Layouts (shared with `kernels/triton_ops/fused_moe.py`):
  hidden:        [T, H]
  router_logits: [T, E]
  topk_weights:  [T, k] float32, routing weight of each token's k chosen experts
  topk_ids:      [T, k] int64, the chosen experts (distinct within a row)
  w13:           [E, 2 * I, H], per expert the gate rows then the up rows (nn.Linear layout)
  w2:            [E, H, I], per expert the down projection
A (token, slot) pair is numbered p = t * k + j; the expert computes
  y_p = w2[e] @ (silu(gate_e @ x_t) * (up_e @ x_t)),  out_t = sum_j topk_weights[t, j] * y_{t*k+j}.
"""
from __future__ import annotations

from typing import Callable

import torch

from kernels import reference as _ref


def moe_route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all E experts (in fp32), keep the top_k; renormalize: divide the kept
    probabilities by their sum. Returns (topk_weights [T, k] float32, topk_ids [T, k] int64)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)  # [T, E]
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def sort_by_expert(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(pairs [T * k] int64: pair indices grouped by expert, ascending within an expert;
    counts [E] int64: how many pairs each expert received)."""
    flat = topk_ids.reshape(-1)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    return torch.argsort(flat, stable=True), counts


def grouped_by_expert(hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                      num_experts: int, expert_mlp: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Sum over each token's k experts of routing weight * expert_mlp(e, rows): [T, H] in hidden.dtype.

    Grouped by expert: expert_mlp(e, x [n, H]) -> [n, H] runs once per expert on all its rows
    (gathered), and the weighted outputs are scatter-added into an fp32 accumulator."""
    t, k = topk_ids.shape
    out = torch.zeros(t, hidden.shape[1], dtype=torch.float32, device=hidden.device)
    if t == 0:
        return out.to(hidden.dtype)
    pairs, counts = sort_by_expert(topk_ids, num_experts)
    tokens = pairs // k  # [T * k] token row of each sorted pair
    weights = topk_weights.reshape(-1)[pairs].float()  # [T * k]
    start = 0
    for e, n in enumerate(counts.tolist()):
        if n == 0:
            continue
        rows = tokens[start:start + n]
        y = expert_mlp(e, hidden.index_select(0, rows))  # [n, H]
        out.index_add_(0, rows, y.float() * weights[start:start + n, None])
        start += n
    return out.to(hidden.dtype)


def fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
    """The experts' gated MLPs, weighted by the routing: [T, H] in hidden.dtype."""
    def expert_mlp(e: int, x: torch.Tensor) -> torch.Tensor:
        return _ref.silu_and_mul(x @ w13[e].t()) @ w2[e].t()  # [n, 2I] -> [n, I] -> [n, H]
    return grouped_by_expert(hidden, topk_weights, topk_ids, w13.shape[0], expert_mlp)
