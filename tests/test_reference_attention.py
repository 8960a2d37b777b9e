"""kernels/reference.paged_attention (the CPU path, batched by shape) against a per-token loop."""
from __future__ import annotations

import pytest
import torch

from kernel_utils import PagedBatch
from kernels.reference import paged_attention


def naive(query, k_cache, v_cache, block_tables, qsl, seq_lens, scale):
    bs, hq, hkv = k_cache.shape[1], query.shape[1], k_cache.shape[2]
    out = torch.empty_like(query)
    for i in range(len(seq_lens)):
        ctx, s, e = int(seq_lens[i]), int(qsl[i]), int(qsl[i + 1])
        rows = [(int(block_tables[i][p // bs]), p % bs) for p in range(ctx)]
        k = torch.stack([k_cache[b, o] for b, o in rows])  # [ctx, Hkv, D]
        v = torch.stack([v_cache[b, o] for b, o in rows])
        for j in range(e - s):
            pos = ctx - (e - s) + j
            for h in range(hq):
                kh = h // (hq // hkv)
                p = ((k[:pos + 1, kh] @ query[s + j, h]) * scale).softmax(0)
                out[s + j, h] = p @ v[:pos + 1, kh]
    return out


@pytest.mark.parametrize("hq,hkv", [(4, 4), (6, 2), (9, 3)])
def test_mixed_batch_with_repeated_shapes_matches_loop(hq, hkv):
    torch.manual_seed(hq)
    bs, d = 4, 8
    # (q_len, ctx): two fresh prompts of the same length (one group), two chunks over the same
    # cached prefix (a masked group), a lone chunk, and decodes of different lengths
    shapes = [(5, 5), (5, 5), (3, 9), (3, 9), (4, 7), (1, 6), (1, 13), (1, 1)]
    nblk = [(ctx + bs - 1) // bs for _, ctx in shapes]
    perm = torch.randperm(sum(nblk) + 3)
    tables, at = torch.zeros(len(shapes), max(nblk), dtype=torch.int32), 0
    for i, n in enumerate(nblk):
        tables[i, :n] = perm[at:at + n]
        at += n
    k_cache = torch.randn(len(perm), bs, hkv, d)
    v_cache = torch.randn(len(perm), bs, hkv, d)
    qsl = torch.tensor([0] + [q for q, _ in shapes], dtype=torch.int32).cumsum(0).to(torch.int32)
    seq_lens = torch.tensor([c for _, c in shapes], dtype=torch.int32)
    query = torch.randn(int(qsl[-1]), hq, d)
    got = paged_attention(query, k_cache, v_cache, tables, qsl, seq_lens, 0.3)
    torch.testing.assert_close(got, naive(query, k_cache, v_cache, tables, qsl, seq_lens, 0.3),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_stale_nan_in_unowned_slots_never_reaches_the_output(dtype):
    """A freed block keeps what its last owner wrote (NaN after an overflow): the slots past a
    sequence's context, in its own last block and in the table's padding, must not leak."""
    batch = PagedBatch([(1, 1), (17, 1), (30, 1), (40, 9), (5, 5)], 6, 2, 8, dtype=dtype, seed=4)
    out = paged_attention(*batch.args())
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out, paged_attention(*batch.clean_args()), atol=0, rtol=0)
