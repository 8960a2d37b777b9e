"""The native paged attention and KV store (kernels/cpu_ops/attention) against the torch reference.

The native kernel reads the NaN-guarded caches of PagedBatch directly (a read of any slot no
sequence owns, or past a buffer, shows up as NaN); the reference gets the cleaned copy.
"""
from __future__ import annotations

import pytest
import torch

from kernels import ops, reference as ref
from kernels.cpu_ops import attention
from kernel_utils import TOL, PagedBatch, needs_native

pytestmark = needs_native


def _check(batch: PagedBatch, dtype, threads=None):
    prev = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        out = attention.paged_attention(*batch.args())
    finally:
        torch.set_num_threads(prev)
    expected = ref.paged_attention(*batch.clean_args())
    assert out.shape == batch.query.shape and out.dtype == dtype
    assert not torch.isnan(out).any(), "NaN in the output: a read outside the sequence's slots"
    torch.testing.assert_close(out.float(), expected.float(), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (9, 3), (8, 2)])  # GQA ratios 1, 3, 4
def test_decode(dtype, hq, hkv):
    seqs = [(1, 1), (15, 1), (16, 1), (17, 1), (100, 1), (250, 1)]
    _check(PagedBatch(seqs, hq, hkv, 64, dtype=dtype, seed=hq), dtype)


def test_block_table_with_padding_rows():
    # a table may have more rows than the batch has sequences (a captured, padded batch): both
    # the native kernel and the reference read only the sequences' rows
    batch = PagedBatch([(5, 1), (17, 1), (33, 1)], 6, 2, 64, seed=3)
    q, k, v, bt, qsl, lens, scale = batch.clean_args()
    padded = torch.cat([bt, bt[:1]])
    want = ref.paged_attention(q, k, v, bt, qsl, lens, scale)
    torch.testing.assert_close(ref.paged_attention(q, k, v, padded, qsl, lens, scale), want)
    torch.testing.assert_close(attention.paged_attention(q, k, v, padded, qsl, lens, scale), want, **TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv,head_dim", [(9, 3, 128), (16, 1, 64), (20, 1, 64), (4, 2, 48), (8, 4, 32)])
@pytest.mark.parametrize("threads", [1, 2])
def test_decode_items_on_either_pass_1(dtype, hq, hkv, head_dim, threads):
    # items of up to 16 query vectors read K where it is stored (bf16: VDPBF16PS where the CPU
    # has it, head_dim a multiple of 32); 20 x 1 heads, bf16 head_dim 48 and the 9-row chunk
    # take the workspace; a lone long decode is split per KV head
    seqs = [(1, 1), (16, 1), (17, 1), (100, 1), (250, 1), (40, 9)]
    _check(PagedBatch(seqs, hq, hkv, head_dim, dtype=dtype, seed=hq + head_dim), dtype, threads)
    _check(PagedBatch([(300, 1)], hq, hkv, head_dim, dtype=dtype, seed=7), dtype, threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_chunks_and_mixed_batch(dtype):
    # fresh prompts, chunks after a cached prefix, and decodes in one call; q_len not a
    # multiple of the 8-row tile, so at G = 3 pass 2 takes both its six-vector groups (tiles
    # of an even row count) and its four-vector ones (odd: 3, 15 or 21 vectors)
    seqs = [(15, 15), (16, 16), (17, 17), (100, 20), (40, 17), (33, 1), (70, 70), (1, 1)]
    _check(PagedBatch(seqs, 6, 2, 64, dtype=dtype, seed=3), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 4), (9, 3), (8, 2), (12, 2), (16, 2), (32, 2)])
@pytest.mark.parametrize("threads", [1, 2])
def test_prefill_tiles_at_every_gqa_ratio(dtype, hq, hkv, threads):
    # on AVX-512 prefill tiles put a head's query vectors in lanes, 64 / G rows a tile (32 at
    # most, 8 at least): G = 1 and 2 take 32 rows (2 and 4 registers of vectors), 3 and 4 take
    # 16 (3 and 4), 6 and 8 take 8 (3 and 4); 16 (128 vectors) keeps a vector per row. On AVX2
    # (8 lanes, 32 / G rows): G = 1 takes 32 rows, 2 takes 16, 3 and 4 take 8 (3 and 4 ymm),
    # 6 and more keep a vector per row. Prompts
    # of many tiles with a ragged last one, a chunk after a cached prefix, a decode, and one
    # long prompt alone (few items: split per KV head)
    seqs = [(150, 150), (300, 77), (40, 1), (33, 33)]
    _check(PagedBatch(seqs, hq, hkv, 64, dtype=dtype, seed=hq * hkv), dtype, threads)
    _check(PagedBatch([(70, 70)], hq, hkv, 128, dtype=dtype, seed=hq + hkv), dtype, threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 8, 32, 4])
def test_block_sizes(block_size, dtype):
    seqs = [(100, 20), (47, 1), (33, 16), (5, 5)]
    _check(PagedBatch(seqs, 6, 2, 64, block_size=block_size, dtype=dtype, seed=4), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [16, 48, 128, 256, 512])
def test_head_dims(dtype, head_dim):
    # prefill tiles, a decode and a 9-row chunk; 512 = the largest head_dim the kernel takes
    seqs = [(23, 23), (50, 1), (40, 9)]
    _check(PagedBatch(seqs, 4, 2, head_dim, dtype=dtype, seed=head_dim), dtype)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_thread_counts_and_per_head_split(threads):
    # one long decode (few items: split per head) and a wide batch (one item per sequence)
    _check(PagedBatch([(300, 1)], 8, 4, 64, seed=5), torch.float32, threads)
    _check(PagedBatch([(30 + i, 1) for i in range(24)], 8, 4, 64, seed=6), torch.float32, threads)


def test_unsupported_inputs_take_the_reference():
    batch = PagedBatch([(23, 23), (50, 1)], 3, 1, 40, seed=7)  # head_dim 40: not a multiple of 16
    assert not attention.supports(batch.query, batch.k_cache)
    out = ops.paged_attention(*batch.clean_args())  # dispatch falls back to the reference
    torch.testing.assert_close(out, ref.paged_attention(*batch.clean_args()), **TOL[torch.float32])
    half = PagedBatch([(10, 1)], 2, 1, 64, dtype=torch.float16, seed=8)
    assert not attention.supports(half.query, half.k_cache)


def test_rejects_query_longer_than_context():
    batch = PagedBatch([(10, 4)], 2, 1, 64, seed=9)
    batch.seq_lens[0] = 3
    with pytest.raises(ValueError, match="q_len > seq_len"):
        attention.paged_attention(*batch.args())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_writes_exactly_the_mapped_slots(dtype):
    g = torch.Generator().manual_seed(11)
    nb, bs, h, d = 6, 4, 2, 16
    k_cache, v_cache = torch.randn(nb, bs, h, d, generator=g).to(dtype), torch.randn(nb, bs, h, d, generator=g).to(dtype)
    kv = torch.randn(5, 3 * h * d, generator=g).to(dtype)  # strided rows, as from a fused qkv
    key, value = kv[:, :h * d].view(5, h, d), kv[:, h * d:2 * h * d].view(5, h, d)
    slots = torch.tensor([3, -1, 23, 0, 9])
    k0, v0 = k_cache.clone(), v_cache.clone()
    ek, ev = k_cache.clone(), v_cache.clone()
    ref.store_kv(key, value, ek, ev, slots)
    attention.store_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, ek) and torch.equal(v_cache, ev)
    k32, v32 = k0.clone(), v0.clone()
    ref.store_kv(key, value, k32, v32, slots.to(torch.int32))  # int32 slots, as the native store takes
    assert torch.equal(k32, ek) and torch.equal(v32, ev)
    with pytest.raises(ValueError, match="outside the cache"):
        attention.store_kv(key, value, k_cache, v_cache, torch.tensor([0, 1, 2, 3, nb * bs]))
