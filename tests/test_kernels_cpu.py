"""The CPU fast paths in kernels/cpu_ops against the torch reference.

The native paged attention reads the NaN-guarded caches of PagedBatch directly (a read of
any slot no sequence owns, or past a buffer, shows up as NaN); the reference gets the
cleaned copy. The packed GEMM is checked against F.linear for every batch size class.
"""
from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from kernels import ops, reference as ref
from kernels.cpu_ops import attention, build, elementwise, isa, linear
from kernel_utils import TOL, PagedBatch, run_avx2_build_probe


def test_native_kernels_build_here():
    # CI machines have a C compiler: the fast path must really be exercised, not skipped
    assert attention.available(), "kernels/cpu_ops failed to build (see the warning logged)"
    assert build.build() == build.build()  # second call: the cached library


def test_build_pads_branches_where_the_assembler_takes_it(tmp_path):
    # x86: GNU as keeps jumps off 32-byte boundaries (the JCC-erratum slowdown, build.py); an
    # assembler that refuses a -Wa flag makes the build go without it, not fail
    cc = build._compiler()
    if cc is None:
        pytest.skip("no C compiler")
    if platform.machine().lower() in ("x86_64", "amd64"):
        assert build._ASFLAGS == ["-Wa,-mbranches-within-32B-boundaries"]
        assert build._compiles(cc, build._CFLAGS + build._ASFLAGS, str(tmp_path))
    assert build._compiles(cc, build._CFLAGS, str(tmp_path))
    assert not build._compiles(cc, build._CFLAGS + ["-Wa,--no-such-assembler-flag"], str(tmp_path))


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
    # 16 (3 and 4), 6 and 8 take 8 (3 and 4); 16 (128 vectors) keeps a vector per row. Prompts
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


def _run_python(code: str, **env) -> subprocess.CompletedProcess:
    full = {**os.environ, **env}
    return subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True,
                          timeout=120)


def test_disabled_by_env_uses_the_reference():
    r = _run_python("from kernels.cpu_ops import attention, linear; import torch;"
                    "print(attention.available(), linear.pack(torch.ones(4, 4)) is None)",
                    LLMSVC_CPU_KERNELS="0")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False", "True"]


def test_no_compiler_falls_back_with_a_warning(tmp_path):
    r = _run_python("import logging; logging.basicConfig();"
                    "from kernels.cpu_ops import attention; print(attention.available())",
                    CC=str(tmp_path / "no-such-cc"), PATH=str(tmp_path), LLMSVC_CACHE=str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"
    assert "CPU kernels unavailable" in r.stderr


def test_ops_on_other_devices_never_load_the_cpu_library(tmp_path):
    """A GPU's ops (greedy argmax on fp32 logits, norms, the attention and packing checks) must
    not build or load the native library; 'meta' tensors stand in for CUDA ones."""
    r = _run_python("import torch; from kernels import ops; from kernels.cpu_ops import attention, build, "
                    "elementwise, linear; x = torch.empty(4, 64, device='meta');"
                    "ops.argmax_rows(x); ops.rms_norm(x, torch.empty(64, device='meta'), 1e-6);"
                    "print(elementwise.supports(x), attention.supports(x, x), linear.pack(x), build._tried)",
                    LLMSVC_CACHE=str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False", "False", "None", "False"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 3, 16, 64, 200, 300, 1024])
@pytest.mark.parametrize("with_bias", [False, True])
# whole panels / ragged last panel, K % 4 / K % 32 == 0 (bf16: the native VNNI panels)
@pytest.mark.parametrize("n,k", [(96, 80), (100, 33), (100, 64)])
def test_packed_linear_matches_f_linear(dtype, m, with_bias, n, k):
    if dtype == torch.bfloat16 and not linear._bf16_ok() and not linear.bf16_packable(k):
        pytest.skip("this CPU has neither oneDNN bf16 nor a native bf16 GEMM")
    g = torch.Generator().manual_seed(m)
    w = torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if with_bias else None
    x = torch.randn(m, k, generator=g).to(dtype)
    packed = linear.pack(w)
    assert packed is not None
    out = ops.linear(x, w, b, packed)
    tol = dict(atol=1e-4, rtol=1e-5) if dtype == torch.float32 else TOL[dtype]
    torch.testing.assert_close(out, F.linear(x, w, b), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_beyond_the_native_limit_run_in_slices_of_it(dtype, monkeypatch):
    """A bf16 step longer than the widened panels' row limit (a --max-num-batched-tokens above
    1024 on a CPU without bf16 arithmetic) is multiplied in slices of the limit through the same
    kernel, bit for bit the slices' own results, instead of falling to torch's GEMM, which
    emulates bf16 there; fp32 and the VNNI layouts (AMX, AVX512-BF16) take torch's GEMM beyond
    their limit, which has their arithmetic."""
    n, k = 96, 64
    g = torch.Generator().manual_seed(7)
    w = torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    packed = linear.pack(w)
    if packed is None or packed.dim() != 3:
        pytest.skip("no native packed GEMM for this dtype on this CPU")
    limit = linear.PANEL_MAX_M if dtype == torch.float32 else linear.bf16_max_m()
    x = torch.randn(2 * limit + 5, k, generator=g).to(dtype)
    calls = []
    native = linear._native

    def counting(entry, xs, *a):
        calls.append(xs.shape[0])
        return native(entry, xs, *a)
    monkeypatch.setattr(linear, "_native", counting)
    out = ops.linear(x, w, b, packed)
    if dtype == torch.float32 or linear.bf16_layout() == "vnni":
        assert calls == []  # F.linear
    else:
        assert calls == [limit, limit, 5]
        parts = torch.cat([native(linear.load().llmsvc_gemm_f32 if dtype == torch.float32 else
                                  linear.load().llmsvc_gemm_bf16, x[i:i + limit], packed, b, w)
                           for i in range(0, x.shape[0], limit)])
        assert torch.equal(out, parts)
    tol = dict(atol=1e-4, rtol=1e-5) if dtype == torch.float32 else TOL[dtype]
    torch.testing.assert_close(out, F.linear(x, w, b), **tol)


@pytest.mark.parametrize("m", [1, 7, 300])
@pytest.mark.parametrize("k", [80, 4100])
def test_fp32_library_gemm_matches_f_linear(monkeypatch, m, k):
    """The fp32 path where the panels do not run (K past _PANEL_MAX_K, or no native build):
    the packed MKL or oneDNN weight, whichever this CPU takes."""
    if linear.FP32_LIBRARY is None:
        pytest.skip("torch has neither MKL nor oneDNN linear here")
    if k <= linear._PANEL_MAX_K:
        monkeypatch.setattr(linear, "_panels_ok", lambda: False)
    g = torch.Generator().manual_seed(k + m)
    w, b, x = torch.randn(72, k, generator=g), torch.randn(72, generator=g), torch.randn(m, k, generator=g)
    packed = linear.pack(w)
    assert packed is not None and packed.dim() != 3  # the library's opaque layout, not panels
    torch.testing.assert_close(ops.linear(x, w, b, packed), F.linear(x, w, b), atol=2e-4, rtol=1e-5)


def test_fp32_decode_rows_take_the_panel_gemm():
    # on an AVX-512 machine (CI's) the panel kernel (gemm.c) must be what runs, not a fallback
    if not isa.at_least("avx2"):
        pytest.skip("neither AVX-512F nor AVX2 + FMA here: fp32 linear uses a library GEMM")
    assert build.load().llmsvc_gemm_f32_supported() == 1
    w = torch.randn(100, 576)
    packed = linear.pack(w)
    assert packed.shape == (3, 576, 48) and packed.data_ptr() % 64 == 0
    sub = build.load().llmsvc_gemm_f32_subpanel()
    assert sub == (48 if isa.at_least("avx512") else 16)
    assert torch.equal(packed, linear.pack_panels(w, sub))
    blocks = packed.view(3, 48 // sub, 576, sub)  # panel 2 holds W[96:100] in its first 4 columns
    torch.testing.assert_close(blocks[2, 0, :, :4], w[96:].t())
    assert blocks[2, 0, :, 4:].abs().sum() == 0 and blocks[2, 1:].abs().sum() == 0  # zero padding past N
    x = torch.randn(2, 5, 576)[:, 1:]  # [2, 4, 576], rows strided
    out = linear._gemm_panels(x, packed, None, w)
    assert out.shape == (2, 4, 100)
    torch.testing.assert_close(out, F.linear(x, w), atol=1e-4, rtol=1e-5)
    lib = build.load()
    bad = torch.empty(packed.numel() + 1)[1:]  # not 64-byte aligned: rejected, not misread
    assert lib.llmsvc_gemm_f32(x.data_ptr(), 576, bad.data_ptr(), None, out.data_ptr(), 100, 1, 100,
                               576, 1) == -1


@pytest.mark.parametrize("sub", [16, 48])
def test_pack_panels_layout(sub):
    """Element (p, j, k, c) of the packed copy, viewed [np, 48 / sub, K, sub], is
    W[48p + sub j + c, k], zero past N."""
    n, k = 101, 40
    w = torch.randn(n, k)
    blocks = linear.pack_panels(w, sub).view(3, 48 // sub, k, sub)
    for p, j, kk, c in [(0, 0, 0, 0), (1, 48 // sub - 1, k - 1, sub - 1), (2, 0, 7, 4), (0, 48 // sub - 1, 3, 2)]:
        col = 48 * p + sub * j + c
        assert blocks[p, j, kk, c] == (w[col, kk] if col < n else 0)
    assert blocks[2].reshape(-1).count_nonzero() == 5 * k  # panel 2: columns 96 .. 100 only
    with pytest.raises(ValueError, match="sub-panel"):
        linear.pack_panels(w, 8)


def test_pack_applies_to_cpu_fp32_and_bf16_only():
    assert linear.pack(torch.ones(8, 8, dtype=torch.float16)) is None
    assert ops.linear(torch.ones(0, 8), torch.ones(4, 8), None, linear.pack(torch.ones(4, 8))).shape == (0, 4)


@pytest.mark.parametrize("nt", [1, 2, 3, 7])
@pytest.mark.parametrize("n", [48, 100, 1000])  # 1, 3 and 21 panels: fewer panels than threads too
def test_panel_gemm_takes_every_panel_once_for_any_thread_count(nt, n):
    # threads own static runs of panels and steal from each other's back: every panel computed
    if build.load().llmsvc_gemm_f32_supported() != 1:
        pytest.skip("neither AVX-512F nor AVX2 + FMA: no panel GEMM")
    g = torch.Generator().manual_seed(n * 10 + nt)
    w, x = torch.randn(n, 64, generator=g), torch.randn(19, 64, generator=g)
    out = torch.full((19, n), float("nan"))
    packed = linear.pack_panels(w)  # held: a temporary would be freed before the call reads it
    assert build.load().llmsvc_gemm_f32(x.data_ptr(), 64, packed.data_ptr(), None,
                                        out.data_ptr(), n, 19, n, 64, nt) == 0
    torch.testing.assert_close(out, F.linear(x, w), atol=1e-4, rtol=1e-5)


# the two bf16 packed GEMMs behind gemm_bf16.c: both read pack_amx's panels
BF16_GEMMS = ["llmsvc_gemm_bf16_amx", "llmsvc_gemm_bf16_dp"]


def _bf16_gemm_or_skip(entry: str):
    lib = build.load()
    if lib is None or getattr(lib, entry + "_supported")() != 1:
        pytest.skip(f"{entry}: not on this CPU (AMX-BF16 / AVX512-BF16 missing, or no tile state)")
    return getattr(lib, entry)


def test_bf16_decode_rows_take_a_native_gemm():
    # on a CPU with AMX-BF16 or AVX512-BF16 (CI's boxes have one or the other) a native kernel
    # must be what runs, AMX where the CPU has it
    if not isa.at_least("avx512_bf16"):
        pytest.skip("neither AMX-BF16 nor AVX512-BF16 here: bf16 takes widened panels or oneDNN")
    lib = build.load()
    assert lib.llmsvc_gemm_bf16_supported() == 1
    amx = lib.llmsvc_gemm_bf16_amx_supported() == 1  # the kernel may also refuse AMX (arch_prctl)
    assert isa.at_least("amx") or not amx
    assert linear.bf16_max_m() == (linear.AMX_MAX_M if amx else linear.DP_MAX_M)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(100, 96, generator=g).bfloat16()
    packed = linear.pack(w)
    assert packed.shape == (2, 48, 128) and packed.data_ptr() % 64 == 0
    # panel 1, K block 2, column tile 1 holds W[64 + 16 + c, 64 + 2r + e] at [r][c][e]
    tile = packed[1].reshape(3, 4, 16, 16, 2)[2, 1]
    torch.testing.assert_close(tile, w[80:96, 64:96].view(16, 16, 2).transpose(0, 1))
    tiles = packed[1].reshape(3, 4, 16, 16, 2)  # zero past N = 100: columns 100..127
    assert tiles[:, 3].abs().sum() == 0 and tiles[:, 2, :, 4:].abs().sum() == 0
    x = torch.randn(2, 5, 96, generator=g).bfloat16()[:, 1:]  # [2, 4, 96], rows strided
    out = linear._gemm_bf16(x, packed, None, w)
    assert out.shape == (2, 4, 100)
    torch.testing.assert_close(out, F.linear(x, w), **TOL[torch.bfloat16])
    bad = torch.empty(packed.numel() + 1, dtype=torch.bfloat16)[1:]  # misaligned: rejected
    for entry in ["llmsvc_gemm_bf16"] + [e for e in BF16_GEMMS if getattr(lib, e + "_supported")() == 1]:
        fn = getattr(lib, entry)
        assert fn(x.data_ptr(), 96, bad.data_ptr(), None, out.data_ptr(), 100, 1, 100, 96, 1) == -1, entry
        assert fn(x.data_ptr(), 96, packed.data_ptr(), None, out.data_ptr(), 100, 1, 100, 80,
                  1) == -1, entry  # K not a multiple of 32


@pytest.mark.parametrize("entry", BF16_GEMMS)
@pytest.mark.parametrize("m", [1, 5, 6, 7, 15, 16, 17, 31, 32, 33, 64, 100, 256])  # row blocks, tails
@pytest.mark.parametrize("n,k", [(64, 32), (130, 96), (1000, 576)])  # ragged last panel and column tile
@pytest.mark.parametrize("with_bias", [False, True])
def test_bf16_gemm_matches_fp32_accumulation(entry, m, n, k, with_bias):
    # fp32 accumulation over the whole K, one rounding: within bf16 rounding of the exact
    # product, as F.linear is; the output rows are NaN beforehand, so a row or column left
    # unwritten fails
    fn = _bf16_gemm_or_skip(entry)
    g = torch.Generator().manual_seed(m * 1000 + n)
    w, x = torch.randn(n, k, generator=g).bfloat16(), torch.randn(m, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if with_bias else None
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16)
    assert fn(x.data_ptr(), k, linear.pack_amx(w).data_ptr(), None if b is None else b.data_ptr(),
              out.data_ptr(), n, m, n, k, 2) == 0
    exact = x.double() @ w.double().T + (0 if b is None else b.double())
    torch.testing.assert_close(out.double(), exact, atol=1e-2, rtol=2 ** -8)
    torch.testing.assert_close(out, F.linear(x, w, b), **TOL[torch.bfloat16])


@pytest.mark.parametrize("entry", BF16_GEMMS)
@pytest.mark.parametrize("nt", [1, 2, 3, 7])
def test_bf16_gemm_covers_every_panel_for_any_thread_count(entry, nt):
    fn = _bf16_gemm_or_skip(entry)
    g = torch.Generator().manual_seed(nt)
    w, x = torch.randn(200, 64, generator=g).bfloat16(), torch.randn(40, 64, generator=g).bfloat16()
    out = torch.full((40, 200), float("nan"), dtype=torch.bfloat16)
    assert fn(x.data_ptr(), 64, linear.pack_amx(w).data_ptr(), None, out.data_ptr(), 200, 40, 200, 64, nt) == 0
    torch.testing.assert_close(out, F.linear(x, w), **TOL[torch.bfloat16])


@pytest.mark.parametrize("nt", [2, 3, 7])
@pytest.mark.parametrize("m,n", [(300, 576), (300, 960), (64, 576), (300, 200), (16, 576), (61, 130)])
def test_bf16_dp_gemm_splits_panel_rows_between_threads_without_changing_a_bit(m, n, nt):
    # 9 panels (N = 576) or 15 on 2 threads, 5 on 3...: with row blocks enough, each panel's rows are
    # split in nt chunks that any thread may take. Every element is written (NaN beforehand) and
    # equals the one-thread result bit for bit: the split moves work, never changes arithmetic.
    _bf16_dp_matches_one_thread(m, n, nt, seed=m + n + nt)


def _bf16_dp_matches_one_thread(m: int, n: int, nt: int, seed: int) -> None:
    """[m, 96] @ [n, 96]^T + bias through gemm_bf16dp.c on 1 and on nt threads: every element
    written (NaN beforehand), the two bit for bit equal, both within bf16 rounding of F.linear"""
    fn = _bf16_gemm_or_skip("llmsvc_gemm_bf16_dp")
    g = torch.Generator().manual_seed(seed)
    w, x = torch.randn(n, 96, generator=g).bfloat16(), torch.randn(m, 96, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16()
    packed = linear.pack_amx(w)
    outs = []
    for threads in (1, nt):
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16)
        assert fn(x.data_ptr(), 96, packed.data_ptr(), b.data_ptr(), out.data_ptr(), n, m, n, 96, threads) == 0
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    torch.testing.assert_close(outs[1], F.linear(x, w, b), **TOL[torch.bfloat16])


@pytest.mark.parametrize("nt", [2, 4])
@pytest.mark.parametrize("m", [1, 6, 16])
@pytest.mark.parametrize("n", [64, 130, 320, 576, 960])  # 1 panel, ragged 3, 5, 9, 15
def test_bf16_dp_gemm_splits_leftover_panels_by_columns_without_changing_a_bit(m, n, nt):
    # too few rows to split a panel's rows: the panels left over after an even share are split
    # into 2 or 4 column parts, one per thread (a part past N, as in the ragged 130, is empty)
    _bf16_dp_matches_one_thread(m, n, nt, seed=m * 7 + n + nt)


def test_bf16_dp_gemm_reads_a_with_its_row_stride():
    # A rows lda > K apart (a column slice of a wider activation), odd lda included
    fn = _bf16_gemm_or_skip("llmsvc_gemm_bf16_dp")
    g = torch.Generator().manual_seed(5)
    w = torch.randn(70, 64, generator=g).bfloat16()
    for lda in (64, 97, 128):
        x = torch.randn(9, lda, generator=g).bfloat16()
        out = torch.empty(9, 70, dtype=torch.bfloat16)
        assert fn(x.data_ptr(), lda, linear.pack_amx(w).data_ptr(), None, out.data_ptr(), 70, 9, 70, 64, 2) == 0
        torch.testing.assert_close(out, F.linear(x[:, :64], w), **TOL[torch.bfloat16])


# -- one-pass elementwise ops (elementwise.c) -----------------------------------------------

EW_TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2)}
EW_DTYPES = [torch.float32, torch.bfloat16]


def _rows(t: int, h: int, dtype, seed: int, pad: int = 0) -> torch.Tensor:
    """[t, h] with row stride h + pad (the pad holds NaN, so a stride bug shows up)."""
    g = torch.Generator().manual_seed(seed)
    buf = torch.full((t, h + pad), float("nan"), dtype=dtype)
    buf[:, :h] = (torch.randn(t, h, generator=g) * 3).to(dtype)
    return buf[:, :h]


@pytest.mark.parametrize("dtype", EW_DTYPES)
@pytest.mark.parametrize("t,h", [(1, 64), (7, 576), (300, 200), (0, 64)])
def test_rms_norm_and_fused_add(dtype, t, h):
    x, res = _rows(t, h, dtype, 1, pad=5), _rows(t, h, dtype, 2, pad=3)
    w = _rows(1, h, dtype, 3)[0]
    assert elementwise.supports(x, res, w.view(1, -1))
    torch.testing.assert_close(elementwise.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6), **EW_TOL[dtype])
    out, s = elementwise.fused_add_rms_norm(x, res, w, 1e-5)
    out_ref, s_ref = ref.fused_add_rms_norm(x, res, w, 1e-5)
    torch.testing.assert_close(s, s_ref, atol=0, rtol=0)  # one rounding of the sum, as the reference
    torch.testing.assert_close(out, out_ref, **EW_TOL[dtype])


@pytest.mark.parametrize("dtype", EW_DTYPES)
@pytest.mark.parametrize("t,d", [(1, 32), (64, 1536), (129, 100)])
def test_silu_and_mul(dtype, t, d):
    x = _rows(t, 2 * d, dtype, 4, pad=7)
    torch.testing.assert_close(elementwise.silu_and_mul(x), ref.silu_and_mul(x), **EW_TOL[dtype])


def test_silu_and_mul_refuses_an_odd_width():
    # [T, 2I]: gate and up halves; an odd width has no halves (it once returned floor(d/2) columns)
    with pytest.raises(ValueError, match="must be even"):
        elementwise.silu_and_mul(torch.randn(2, 7))


def test_norms_wider_than_the_native_row_buffer_take_the_reference():
    h = elementwise.MAX_NORM_HIDDEN + 4464
    x, res, w = torch.randn(2, h), torch.randn(2, h), torch.rand(h) + 0.5
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6))
    for got, want in zip(ops.fused_add_rms_norm(x, res, w, 1e-6), ref.fused_add_rms_norm(x, res, w, 1e-6)):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("dtype", EW_DTYPES)
def test_silu_and_mul_far_gates_stay_finite(dtype):
    """silu(g) -> 0 for g far below 0 and -> g far above it: e^-g past fp32's range once gave NaN
    (a reciprocal estimate of an infinite divisor) and must not."""
    gates = torch.tensor([-1e4, -1e3, -100.0, -89.0, -88.0, -87.0, -20.0, 0.0, 20.0, 88.0, 100.0, 1e3, 3e4])
    d = 40  # two full vectors of 16 and a tail
    x = torch.randn(3, 2 * d, generator=torch.Generator().manual_seed(6))
    x[:, :len(gates)] = gates
    x = x.to(dtype)
    out = elementwise.silu_and_mul(x)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref.silu_and_mul(x), **EW_TOL[dtype])


@pytest.mark.parametrize("flag", ["-mno-avx512bf16", "-mno-avx512f"])
def test_elementwise_on_cpus_without_the_vector_paths(tmp_path, flag):
    """elementwise.c built for a CPU without AVX512-BF16 (bf16 through the scalar macros and
    bf16.h's integer rounding) or without AVX-512 (every op through the macros), against the
    reference: the paths such CPUs run, which this machine would not."""
    import ctypes

    cc = build._compiler()
    if cc is None or build.load() is None:
        pytest.skip("no C compiler: the kernels are not built here")
    src = os.path.join(os.path.dirname(build.__file__), "elementwise.c")
    obj, so = tmp_path / "ew.o", tmp_path / "ew.so"
    subprocess.check_call([cc, *build._CFLAGS, flag, "-c", src, "-o", str(obj)])
    subprocess.check_call([cc, str(obj), *build._LDFLAGS, "-o", str(so)])
    lib = ctypes.CDLL(str(so))
    P, I64, I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.llmsvc_silu_and_mul.argtypes = [I, P, I64, P, I64, I64, I]
    lib.llmsvc_fused_add_rms_norm.argtypes = [I, P, I64, P, I64, P, P, P, I64, I64, ctypes.c_float, I]
    for code, dtype in ((0, torch.float32), (1, torch.bfloat16)):
        x = _rows(33, 2 * 100, dtype, 7, pad=3)
        x[0, :4] = torch.tensor([-1e3, -89.0, 88.0, 1e3], dtype=dtype)
        out = torch.empty(33, 100, dtype=dtype)
        assert lib.llmsvc_silu_and_mul(code, x.data_ptr(), x.stride(0), out.data_ptr(), 33, 100, 2) == 0
        torch.testing.assert_close(out, ref.silu_and_mul(x), **EW_TOL[dtype])
        h, res, w = _rows(9, 576, dtype, 8), _rows(9, 576, dtype, 9), _rows(1, 576, dtype, 10)[0]
        o, s = torch.empty(9, 576, dtype=dtype), torch.empty(9, 576, dtype=dtype)
        assert lib.llmsvc_fused_add_rms_norm(code, h.data_ptr(), h.stride(0), res.data_ptr(), res.stride(0),
                                             w.data_ptr(), o.data_ptr(), s.data_ptr(), 9, 576, 1e-5, 2) == 0
        o_ref, s_ref = ref.fused_add_rms_norm(h, res, w, 1e-5)
        torch.testing.assert_close(s, s_ref, atol=0, rtol=0)
        torch.testing.assert_close(o, o_ref, **EW_TOL[dtype])


@pytest.mark.parametrize("dtype", EW_DTYPES)
@pytest.mark.parametrize("hq,hkv,d,rot", [(9, 3, 64, 64), (4, 1, 128, 64), (2, 2, 32, 16)])
def test_rotary_embedding_in_place_on_strided_views(dtype, hq, hkv, d, rot):
    t = 37
    qkv = _rows(t, (hq + 2 * hkv) * d, dtype, 5)
    cache = torch.randn(4096, rot, generator=torch.Generator().manual_seed(6))
    positions = torch.randint(0, 4096, (t,), generator=torch.Generator().manual_seed(7))
    expected = qkv.clone()
    ref.rotary_embedding(positions, expected[:, :hq * d], expected[:, hq * d:(hq + hkv) * d], cache, d)
    elementwise.rotary_embedding(positions, qkv[:, :hq * d], qkv[:, hq * d:(hq + hkv) * d], cache, d)
    torch.testing.assert_close(qkv, expected, **EW_TOL[dtype])  # v untouched, q and k rotated


def test_rotary_rejects_out_of_range_positions():
    q, k = torch.zeros(2, 64), torch.zeros(2, 64)
    with pytest.raises(ValueError, match="out of range"):
        elementwise.rotary_embedding(torch.tensor([0, 10]), q, k, torch.zeros(10, 64), 64)


def test_ops_dispatch_uses_the_native_kernels(monkeypatch):
    calls = []
    for name in ("rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_embedding"):
        fn = getattr(elementwise, name)
        monkeypatch.setattr(elementwise, name, lambda *a, _fn=fn, _n=name: calls.append(_n) or _fn(*a))
    x, w = torch.randn(3, 64), torch.ones(64)
    ops.rms_norm(x, w, 1e-6)
    ops.fused_add_rms_norm(x, x.clone(), w, 1e-6)
    ops.silu_and_mul(torch.randn(3, 128))
    ops.rotary_embedding(torch.arange(3), x, x.clone(), torch.zeros(8, 64), 64)
    assert calls == ["rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_embedding"]


@pytest.mark.parametrize("t,v", [(1, 1), (3, 7), (64, 49152), (5, 100000)])
def test_argmax_rows_first_maximum(t, v):
    g = torch.Generator().manual_seed(v)
    x = torch.randn(t, v + 3, generator=g)[:, :v]  # strided rows
    x[0, v // 2] = x[0, v - 1] = 99.0  # a tie: the first index wins, as in torch
    torch.testing.assert_close(elementwise.argmax_rows(x), x.argmax(dim=-1), atol=0, rtol=0)
    torch.testing.assert_close(ops.argmax_rows(x), x.argmax(dim=-1), atol=0, rtol=0)


def test_argmax_rows_nan_counts_as_maximum():
    x = torch.tensor([[1.0, float("nan"), 5.0], [float("nan"), 2.0, 3.0], [float("-inf"), -1.0, -2.0]])
    assert elementwise.argmax_rows(x).tolist() == x.argmax(dim=-1).tolist() == [1, 0, 1]


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


_AVX2_PROBE = """
import torch, torch.nn.functional as F
from kernels import reference as ref
from kernels.cpu_ops import attention, build, linear
lib = build.load()
assert lib.llmsvc_gemm_f32_supported() == 1
g = torch.Generator().manual_seed(0)
for n, k in ((48, 64), (50, 35), (100, 576), (1000, 1536)):
    w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    packed = linear.pack_panels(w)  # held: the call gets only its address
    for m in (1, 5, 6, 7, 64, 300):
        x = torch.randn(m, k, generator=g)
        for nt in (1, 2, 3):
            out = torch.full((m, n), float("nan"))
            assert lib.llmsvc_gemm_f32(x.data_ptr(), k, packed.data_ptr(), b.data_ptr(),
                                       out.data_ptr(), n, m, n, k, nt) == 0
            torch.testing.assert_close(out, F.linear(x, w, b), atol=1e-3, rtol=1e-4)
for dtype, tol in ((torch.float32, 2e-5), (torch.bfloat16, 2e-2)):
    for hq, hkv, d, lens in ((9, 3, 64, [(1, 37), (1, 200), (1, 5)]), (4, 2, 128, [(19, 19), (3, 40)]),
                             (2, 1, 32, [(40, 70), (1, 16)])):
        bs, nb = 16, 64
        kc, vc = (torch.randn(nb, bs, hkv, d, generator=g).to(dtype) for _ in range(2))
        qlens = [q for q, _ in lens]
        q = torch.randn(sum(qlens), hq, d, generator=g).to(dtype)
        perm = torch.randperm(nb, generator=g)
        bt = torch.stack([perm[i * 14:(i + 1) * 14] for i in range(len(lens))]).to(torch.int32)  # 224 keys each
        qsl = torch.tensor([0] + qlens).cumsum(0).to(torch.int32)
        sl = torch.tensor([c for _, c in lens], dtype=torch.int32)
        for window in (0, 24):
            got = attention.paged_attention(q, kc, vc, bt, qsl, sl, d ** -0.5, window)
            want = ref.paged_attention(q, kc, vc, bt, qsl, sl, d ** -0.5, window)
            torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
print("ok")
"""


def test_gemm_and_attention_built_for_avx2():
    """The panel GEMM and paged attention as an AVX2 CPU without AVX-512 runs them (built with
    LLMSVC_CPU_ISA=avx2, in a fresh process), against F.linear and
    the reference: ragged panels, 6-row blocks and their remainders, GQA decodes and prefill
    tiles, sliding windows, fp32 and bf16."""
    run_avx2_build_probe(_AVX2_PROBE)


# x86-64 feature levels the C sources branch on: SSE4.2 only, AVX2 + FMA, AVX-512F,
# AVX512-BF16, AMX. Each machine builds only its own (-march=native), so a change that breaks
# another level's branch would pass here and fail on that CPU.
_MARCHES = ["x86-64-v2", "x86-64-v3", "skylake-avx512", "cooperlake", "sapphirerapids"]


@pytest.mark.parametrize("march", _MARCHES)
def test_c_sources_compile_for_every_x86_feature_level(march):
    import platform

    cc = build._compiler()
    if cc is None or platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("needs a C compiler targeting x86-64")
    flags = [f if f != "-march=native" else f"-march={march}" for f in build._CFLAGS]
    for src in build._SOURCES:
        r = subprocess.run([cc, *flags, "-Werror=incompatible-pointer-types", "-fsyntax-only", str(src)],
                           capture_output=True, text=True)
        if r.returncode and "bad value" in r.stderr:
            pytest.skip(f"{cc} does not know -march={march}")
        assert r.returncode == 0, f"{src.name} for {march}:\n{r.stderr[-2000:]}"
