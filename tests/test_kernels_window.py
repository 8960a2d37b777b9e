"""Sliding-window and soft-capped paged attention: the torch reference against a per-token
loop, and the CPU kernel and the Triton kernels (interpreter) against the reference.

Slots before each sequence's first window start hold NaN in the kernels' inputs
(`PagedBatch.forget_before_window`), as when the KV manager has freed those blocks: a kernel
that reads a key outside the window shows NaN.
"""
from __future__ import annotations

import pytest
import torch

from kernel_utils import TOL, PagedBatch, needs_native
from kernels import ops, reference as ref
from kernels.cpu_ops import attention
from kernels.triton_ops import HAS_TRITON, INTERPRET

# (ctx, q_len): decodes inside, at and past the window, a fresh prompt longer than the window,
# chunks whose rows straddle the window start, a lone first token
SEQS = [(1, 1), (7, 1), (8, 1), (9, 1), (45, 1), (40, 40), (61, 13), (30, 6), (20, 20)]


def naive(query, k_cache, v_cache, block_tables, qsl, seq_lens, scale, window, soft_cap):
    bs, hq, hkv = k_cache.shape[1], query.shape[1], k_cache.shape[2]
    out = torch.empty_like(query)
    for i in range(len(seq_lens)):
        ctx, s, e = int(seq_lens[i]), int(qsl[i]), int(qsl[i + 1])
        for j in range(e - s):
            pos = ctx - (e - s) + j
            lo = max(0, pos - window + 1) if window else 0
            rows = [(int(block_tables[i][p // bs]), p % bs) for p in range(lo, pos + 1)]
            k = torch.stack([k_cache[b, o] for b, o in rows]).double()  # [n, Hkv, D]
            v = torch.stack([v_cache[b, o] for b, o in rows]).double()
            for h in range(hq):
                kh = h // (hq // hkv)
                sc = (k[:, kh] @ query[s + j, h].double()) * scale
                if soft_cap:
                    sc = soft_cap * torch.tanh(sc / soft_cap)
                out[s + j, h] = (sc.softmax(0) @ v[:, kh]).to(out.dtype)
    return out


@pytest.mark.parametrize("window,soft_cap", [(8, 0.0), (16, 0.0), (0, 2.0), (8, 1.5)])
def test_reference_matches_loop(window, soft_cap):
    batch = PagedBatch(SEQS, 6, 2, 16, block_size=4, seed=window)
    batch.query.mul_(4)  # scores of several units: the cap bites
    args = batch.clean_args()
    got = ref.paged_attention(*args, window, soft_cap)
    torch.testing.assert_close(got, naive(*args, window, soft_cap), atol=1e-5, rtol=1e-5)
    if window:  # the window changes the answer for rows past it
        assert not torch.allclose(got, ref.paged_attention(*args, 0, soft_cap))


def test_reference_never_reads_outside_the_window():
    batch = PagedBatch(SEQS, 4, 4, 16, block_size=4, seed=3)
    expected = ref.paged_attention(*batch.clean_args(), 8, 0.0)
    batch.forget_before_window(8)
    got = ref.paged_attention(*batch.clean_args()[:1], *batch.args()[1:], 8, 0.0)
    assert not torch.isnan(got).any()
    torch.testing.assert_close(got, expected, atol=0, rtol=0)


def _expected(batch, window, soft_cap):
    return ref.paged_attention(*batch.clean_args(), window, soft_cap)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@needs_native
@pytest.mark.parametrize("window,soft_cap,block_size", [(8, 0.0, 4), (24, 0.0, 16), (5, 0.0, 16),
                                                        (0, 3.0, 16), (12, 2.0, 8)])
def test_cpu_kernel_matches_reference(dtype, window, soft_cap, block_size):
    assert attention.available()
    batch = PagedBatch(SEQS, 6, 2, 32, block_size=block_size, dtype=dtype, seed=window + block_size)
    batch.query.mul_(3)
    expected = _expected(batch, window, soft_cap)
    if window:
        batch.forget_before_window(window)
    got = attention.paged_attention(*batch.args(), window, soft_cap)
    assert not torch.isnan(got).any(), "a key outside the window was read"
    torch.testing.assert_close(got.float(), expected.float(), **TOL[dtype])


@needs_native
@pytest.mark.parametrize("threads", [1, 3])
def test_cpu_kernel_window_with_per_head_items(threads):
    # few items: split per KV head; long decode past a short window
    batch = PagedBatch([(300, 1), (90, 1)], 8, 4, 64, seed=5)
    expected = _expected(batch, 32, 0.0)
    batch.forget_before_window(32)
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = attention.paged_attention(*batch.args(), 32, 0.0)
    finally:
        torch.set_num_threads(prev)
    torch.testing.assert_close(got, expected, **TOL[torch.float32])


@pytest.mark.skipif(not (HAS_TRITON and INTERPRET), reason="Triton interpreter not available")
@pytest.mark.parametrize("window,soft_cap,split", [(8, 0.0, None), (40, 0.0, 32), (0, 2.5, None),
                                                   (8, 2.0, 32), (33, 0.0, 32)])
def test_triton_kernels_match_reference(window, soft_cap, split):
    from kernels.triton_ops.paged_attention import paged_attention as triton_paged_attention
    # decodes long enough for several 32-key splits, some wholly before the window
    batch = PagedBatch(SEQS + [(100, 1), (70, 1)], 6, 2, 32, block_size=8, seed=window + 1)
    batch.query.mul_(3)
    expected = _expected(batch, window, soft_cap)
    if window:
        batch.forget_before_window(window)
    got = triton_paged_attention(*batch.args(), decode_split_size=split, sliding_window=window,
                                 soft_cap=soft_cap)
    assert not torch.isnan(got).any(), "a key outside the window was read"
    torch.testing.assert_close(got, expected, **TOL[torch.float32])


@pytest.mark.skipif(not (HAS_TRITON and INTERPRET), reason="Triton interpreter not available")
def test_ops_dispatch_passes_the_window_to_every_path():
    batch = PagedBatch(SEQS, 4, 2, 32, block_size=4, seed=9)
    expected = _expected(batch, 8, 1.0)
    batch.forget_before_window(8)
    outs = [ops.paged_attention(*batch.args(), sliding_window=8, soft_cap=1.0)]
    with ops.force_triton():
        outs.append(ops.paged_attention(*batch.args(), sliding_window=8, soft_cap=1.0))
    for out in outs:
        torch.testing.assert_close(out, expected, **TOL[torch.float32])
