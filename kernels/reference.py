"""Torch reference implementation of every op: the CPU path and the tests' ground truth.

Layouts (shared with the Triton kernels):
  k_cache, v_cache:  [num_blocks, block_size, num_kv_heads, head_dim]
  slot_mapping:      [num_tokens] int64, slot = block_id * block_size + offset; -1 = skip
  block_tables:      [num_seqs, max_blocks_per_seq] int32 (physical block ids, padded)
  query_start_loc:   [num_seqs + 1] int32, cumulative query lengths (tokens of this step)
  seq_lens:          [num_seqs] int32, context length per sequence *including* this step's tokens
  cos_sin_cache:     [max_position, rotary_dim] (cos in the first half, sin in the second)
"""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x: [num_tokens, hidden]; computed in fp32, returned in x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight.float()).to(x.dtype)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    # returns (rms_norm(x + residual), x + residual); the sum is rounded to x.dtype first, as HF does
    s = (x.float() + residual.float()).to(x.dtype)
    return rms_norm(s, weight, eps), s


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    # x: [num_tokens, 2 * d] (gate | up) -> [num_tokens, d]
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                     cos_sin_cache: torch.Tensor, head_size: int) -> None:
    """Neox-style RoPE applied in place. query: [T, Hq * head_size], key: [T, Hkv * head_size]."""
    cos_sin = cos_sin_cache.index_select(0, positions)  # [T, rotary_dim]
    cos, sin = cos_sin.chunk(2, dim=-1)  # [T, rotary_dim / 2] each
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    rot = cos_sin_cache.shape[-1]
    for x in (query, key):
        xv = x.view(x.shape[0], -1, head_size)  # [T, H, head_size]
        xr = xv[..., :rot].float()
        x1, x2 = xr.chunk(2, dim=-1)
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        xv[..., :rot] = out.to(x.dtype)


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """key, value: [T, Hkv, D] written to the cache slots named by slot_mapping (in place)."""
    nb, bs, h, d = k_cache.shape
    slot_mapping = slot_mapping.long()  # int32 too, as the native and Triton stores take
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    k_cache.view(nb * bs, h, d).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.view(nb * bs, h, d).index_copy_(0, slot_mapping, value.to(v_cache.dtype))


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x: [T, V] -> [T] int64, index of the first maximum of each row."""
    return x.argmax(dim=-1)


def _gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """cache [N, bs, H, D], block_ids [...] -> [..., bs, H, D] (index_select: one memcpy per block)."""
    flat = cache.index_select(0, block_ids.reshape(-1).long())
    return flat.view(*block_ids.shape, *cache.shape[1:])


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
            soft_cap: float) -> torch.Tensor:
    """SDPA with a boolean mask (True = visible); soft_cap > 0 first squashes every score into
    (-soft_cap, soft_cap) with soft_cap * tanh(score / soft_cap) (Gemma's logit softcapping)."""
    if soft_cap <= 0:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    s = torch.tanh(s / soft_cap) * soft_cap
    p = s.masked_fill(~mask, float("-inf")).softmax(-1)
    return torch.matmul(p, v.float()).to(q.dtype)


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                    seq_lens: torch.Tensor, scale: float, sliding_window: int = 0,
                    soft_cap: float = 0.0) -> torch.Tensor:
    """Causal attention of a flattened batch over the paged cache.

    query: [T, Hq, D]. Sequence i owns query rows query_start_loc[i]:query_start_loc[i+1]
    (its last q_len tokens); query row j of it, at position p = ctx - q_len + j with
    ctx = seq_lens[i], attends to cache positions max(0, p - sliding_window + 1)..p
    (sliding_window 0: from 0, plain causal). Cache slots before the first row's window are
    never read: their blocks may have been handed to another sequence. soft_cap > 0 caps the
    scores (see _attend). The new tokens' K/V must already be in the cache (store_kv first).
    GQA without expanding K/V: the G = Hq / Hkv query heads of a KV head become G query rows.
    Decode rows (q_len == 1) are batched into one call; longer chunks run one by one.
    Returns [T, Hq, D] in query.dtype.
    """
    num_tokens, hq, d = query.shape
    _, bs, hkv, _ = k_cache.shape
    g = hq // hkv
    out = torch.empty_like(query)
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    q_lens = [qsl[i + 1] - qsl[i] for i in range(len(lens))]
    decode = [i for i, n in enumerate(q_lens) if n == 1]
    if decode:
        n_dec = len(decode)
        nblk = (max(lens[i] for i in decode) + bs - 1) // bs
        if n_dec == len(lens) and n_dec == num_tokens:  # pure decode batch: rows are 0..B-1
            rows, bt, ctx = None, block_tables[:n_dec, :nblk], seq_lens  # the table may have padding rows
        else:
            idx = torch.tensor(decode, device=query.device)
            rows, bt, ctx = query_start_loc[idx].long(), block_tables[idx, :nblk], seq_lens[idx]
        k = _gather_blocks(k_cache, bt).flatten(1, 2).transpose(1, 2)  # [B, Hkv, nblk*bs, D]
        v = _gather_blocks(v_cache, bt).flatten(1, 2).transpose(1, 2)
        key_pos = torch.arange(nblk * bs, device=query.device)
        mask = key_pos < ctx[:, None]  # [B, S]
        if sliding_window > 0:
            mask &= key_pos >= ctx[:, None] - sliding_window
        # slots outside the mask hold whatever a block's last owner left (NaN after an
        # overflow): zero them, since a masked score still multiplies its V row by 0 (0 * NaN = NaN)
        k, v = (x.masked_fill(~mask[:, None, :, None], 0) for x in (k, v))
        q = (query if rows is None else query[rows]).view(n_dec, hkv, g, d)  # [B, Hkv, G, D]
        o = _attend(q.to(k.dtype), k, v, mask[:, None, None, :], scale, soft_cap)
        o = o.reshape(n_dec, hq, d).to(out.dtype)
        if rows is None:
            out.copy_(o)
        else:
            out[rows] = o
    for i, q_len in enumerate(q_lens):
        if q_len <= 1:
            continue
        ctx = lens[i]
        nblk = (ctx + bs - 1) // bs
        # first key any row may see (the first row's window start): earlier slots are never read
        lo = max(0, ctx - q_len + 1 - sliding_window) if sliding_window > 0 else 0
        k = _gather_blocks(k_cache, block_tables[i, :nblk]).flatten(0, 1)[lo:ctx].transpose(0, 1)  # [Hkv, ctx-lo, D]
        v = _gather_blocks(v_cache, block_tables[i, :nblk]).flatten(0, 1)[lo:ctx].transpose(0, 1)
        # [q_len, Hq, D] -> [Hkv, G * q_len, D]: row (g, j) is query head h*G+g at new token j
        q = query[qsl[i]:qsl[i + 1]].view(q_len, hkv, g, d).permute(1, 2, 0, 3).reshape(hkv, g * q_len, d)
        # bottom-right aligned causal mask: token j sees keys < ctx - q_len + j + 1
        key_pos = torch.arange(lo, ctx, device=query.device)[None, :]
        q_pos = torch.arange(ctx - q_len, ctx, device=query.device)[:, None]
        mask = key_pos <= q_pos  # [q_len, ctx - lo]
        if sliding_window > 0:
            mask &= key_pos > q_pos - sliding_window
        o = _attend(q.to(k.dtype), k, v, mask.repeat(g, 1), scale, soft_cap)
        o = o.view(hkv, g, q_len, d).permute(2, 0, 1, 3).reshape(q_len, hq, d)
        out[qsl[i]:qsl[i + 1]] = o.to(out.dtype)
    return out


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """Structured output: set every token a grammar forbids to -inf, in place.

    logits [S, V] float; bitmask [R, W] int32, bit t % 32 of word t // 32 set iff token t is
    allowed in the grammar row; rows [R] int64, the logits row each bitmask row applies to
    (unique). Tokens >= 32 * W (model vocab padded past the tokenizer's) are forbidden; bits
    >= V (mask wider than the logits) are ignored. Rows not listed are untouched.
    """
    R, W = bitmask.shape
    S, V = logits.shape
    if R == 0:
        return
    assert sys.byteorder == "little"  # byte k of a row holds tokens 8k .. 8k+7, lowest bit first
    shifts = torch.arange(8, dtype=torch.uint8, device=bitmask.device)
    bits = (bitmask.contiguous().view(torch.uint8).unsqueeze(-1) >> shifts) & 1  # [R, 4W, 8] uint8
    forbid = bits.view(R, W * 32)[:, :V] == 0  # [R, min(V, 32W)]
    if forbid.shape[1] < V:
        forbid = torch.nn.functional.pad(forbid, (0, V - forbid.shape[1]), value=True)
    if R == S and torch.equal(rows, torch.arange(S, device=rows.device)):
        logits.masked_fill_(forbid, float("-inf"))  # every row, in order: no gather / scatter
        return
    sub = logits.index_select(0, rows)  # [R, V]
    sub.masked_fill_(forbid, float("-inf"))
    logits.index_copy_(0, rows, sub)


def lora_add_(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
              groups: list[tuple[int, torch.Tensor | None]]) -> None:
    """In place, for every (slot, rows) of groups: y[rows] += (x[rows] @ lora_a[slot].T) @ lora_b[slot].T.

    y: [T, N], x: [T, K], lora_a: [slots, R, K], lora_b: [slots, N, R] (the adapter's scaling
    already in lora_b); rows: int64 token indices, or None for every token. A token in no group
    gets nothing added (the base model)."""
    for slot, rows in groups:
        if rows is None:
            y += (x @ lora_a[slot].T) @ lora_b[slot].T
        else:
            y.index_add_(0, rows, (x.index_select(0, rows) @ lora_a[slot].T) @ lora_b[slot].T)


def dequantize_gguf_blocks(qweight: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """GGUF Q4_0 / Q4_1 / Q8_0 blocks -> fp32 weight [N, K]: W[n, k] = scale[n, k // 32] *
    qweight[n, k] + offset[n, k // 32], as gguf-py dequantizes them (scale * q is exact in fp32:
    an fp16 scale times |q| <= 128), so the result equals the checkpoint's fp32 weight bit for bit.
    qweight [N, K] int8; scale, offset [N, K / 32] fp32 (offset 0 for Q4_0 and Q8_0)."""
    block = qweight.shape[1] // scale.shape[1]
    return scale.repeat_interleave(block, 1) * qweight.float() + offset.repeat_interleave(block, 1)
