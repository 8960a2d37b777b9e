"""Attention over the paged KV cache, for a flattened batch of prefill chunks and decodes.

Batch layout (B sequences, T tokens this step, no padding between sequences):
sequence i owns token rows query_start_loc[i]:query_start_loc[i+1], which are its
LAST q_len_i tokens of a context of seq_lens[i] tokens (prefix already in the cache).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from kernels import ops


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64, block_id * block_size + offset per new token; -1 = skip
    block_tables: torch.Tensor  # [B, max_blocks_per_seq] int32, physical block ids (padded)
    query_start_loc: torch.Tensor  # [B + 1] int32, cumulative query lengths
    seq_lens: torch.Tensor  # [B] int32, context length incl. this step's tokens
    max_query_len: int
    max_seq_len: int

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    def to(self, device) -> "AttentionMetadata":
        return AttentionMetadata(self.slot_mapping.to(device), self.block_tables.to(device),
                                 self.query_start_loc.to(device), self.seq_lens.to(device),
                                 self.max_query_len, self.max_seq_len)


class Attention(nn.Module):
    """Stores this step's K/V into the cache, then attends over cache (prefix + new).

    sliding_window > 0: a token sees only the last sliding_window positions (itself included),
    as transformers' sliding-window mask; soft_cap > 0: scores pass through
    soft_cap * tanh(score / soft_cap) before the softmax."""

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 sliding_window: int = 0, soft_cap: float = 0.0):
        super().__init__()
        self.num_heads, self.head_size, self.num_kv_heads = num_heads, head_size, num_kv_heads
        self.scale = scale
        self.sliding_window, self.soft_cap = int(sliding_window or 0), float(soft_cap or 0.0)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor] | None,
                meta: AttentionMetadata) -> torch.Tensor:
        """q: [T, Hq * D], k, v: [T, Hkv * D]; kv_cache: (k_cache, v_cache), each
        [num_blocks, block_size, Hkv, D]. Returns [T, Hq * D].

        kv_cache None (or empty) is the profiling / cache-less path: every sequence must
        be a full prompt (query len == seq len) and plain causal attention is used."""
        t = q.shape[0]
        q = q.view(t, self.num_heads, self.head_size)
        k = k.view(t, self.num_kv_heads, self.head_size)
        v = v.view(t, self.num_kv_heads, self.head_size)
        if kv_cache is None or kv_cache[0].numel() == 0:
            return self._no_cache(q, k, v, meta).reshape(t, -1)
        k_cache, v_cache = kv_cache
        ops.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = ops.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.query_start_loc,
                                  meta.seq_lens, self.scale, max_query_len=meta.max_query_len,
                                  max_seq_len=meta.max_seq_len, sliding_window=self.sliding_window,
                                  soft_cap=self.soft_cap)
        return out.reshape(t, -1)

    def _no_cache(self, q, k, v, meta: AttentionMetadata) -> torch.Tensor:
        out = torch.empty_like(q)
        qsl = meta.query_start_loc.tolist()
        for i in range(len(qsl) - 1):
            s, e = qsl[i], qsl[i + 1]
            if e == s:
                continue
            qi, ki, vi = (x[s:e].transpose(0, 1) for x in (q, k, v))  # [H, n, D]
            if not self.sliding_window and not self.soft_cap:
                o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=self.scale,
                                                   enable_gqa=self.num_heads != self.num_kv_heads)
            else:
                o = self._masked(qi, ki, vi)
            out[s:e] = o.transpose(0, 1)
        return out

    def _masked(self, q, k, v) -> torch.Tensor:
        """q: [Hq, n, D], k, v: [Hkv, n, D] of one full prompt -> [Hq, n, D], with the window
        and the soft cap (fp32 scores)."""
        n, g = q.shape[1], self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(g, 0), v.repeat_interleave(g, 0)
        scores = torch.matmul(q.float(), k.float().transpose(1, 2)) * self.scale  # [Hq, n, n]
        if self.soft_cap:
            scores = torch.tanh(scores / self.soft_cap) * self.soft_cap
        pos = torch.arange(n, device=q.device)
        mask = pos[None, :] <= pos[:, None]
        if self.sliding_window:
            mask &= pos[None, :] > pos[:, None] - self.sliding_window
        p = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        return torch.matmul(p, v.float()).to(q.dtype)
