"""The native bf16 GEMMs (gemm_bf16.c: AMX and AVX512-BF16 over pack_amx's panels) against fp32
accumulation and F.linear, and their work split between threads, bit for bit the one-thread result."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.cpu_ops import build, isa, linear
from kernel_utils import TOL


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
