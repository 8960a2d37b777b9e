"""The bf16 GEMM of CPUs with neither AMX nor AVX512-BF16 (gemm.c's llmsvc_gemm_bf16_widen,
behind gemm_bf16.c; AVX2 + FMA or plain AVX-512F): bf16 operands in gemm.c's fp32 panel layout,
widened to fp32 and rounded once. Its reference is gemm.c's fp32 entry on the widened operands,
which it must equal bit for bit (then torch's round-to-nearest-even), and F.linear.

The in-process library builds this entry for the CPU it runs on (AVX-512: [K][48] panels, A
widened by rows; AVX2: [K][16] sub-panels, A packed [K][6]); the last test builds the library
with -mno-avx512f in a fresh process, as an AVX2-only CPU would."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import ops
from kernels.cpu_ops import build, linear
from kernel_utils import TOL, needs_native, run_avx2_build_probe


def _widen_or_skip():
    lib = build.load()
    if lib is None or lib.llmsvc_gemm_bf16_widen_supported() != 1:
        pytest.skip("this build has no widening bf16 GEMM (neither AVX-512F nor AVX2 + FMA)")
    return lib


def _fp32_then_round(x, w, b, lda_k):
    """gemm.c's fp32 entry on the widened operands, rounded by torch (nearest even)."""
    lib = build.load()
    m, n = x.shape[0], w.shape[0]
    out = torch.empty(m, n)
    packed, xf = linear.pack_panels(w.float()), x.float()  # held: the call gets only addresses
    bf = None if b is None else b.float()
    assert lib.llmsvc_gemm_f32(xf.data_ptr(), xf.stride(0), packed.data_ptr(),
                               None if bf is None else bf.data_ptr(), out.data_ptr(), n, m, n, lda_k, 1) == 0
    return out.bfloat16()


# row blocks of 6 (AVX2) or 8 (AVX-512) and tails, widened in registers (up to 7 blocks) or into
# a panel buffer (64: 11 or 8 blocks; 300: chunks of 256 and 44 rows)
@pytest.mark.parametrize("m", [1, 5, 6, 7, 8, 42, 64, 300])
@pytest.mark.parametrize("n,k", [(48, 64), (50, 35), (130, 33), (100, 576)])  # ragged panels, odd K
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("nt", [1, 3])
def test_widen_gemm_is_the_fp32_gemm_on_widened_operands(m, n, k, with_bias, nt):
    lib = _widen_or_skip()
    g = torch.Generator().manual_seed(m * 100 + n + k)
    w, x = torch.randn(n, k, generator=g).bfloat16(), torch.randn(m, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if with_bias else None
    packed = linear.pack_panels(w)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16)  # an unwritten element stays NaN
    assert lib.llmsvc_gemm_bf16_widen(x.data_ptr(), k, packed.data_ptr(), None if b is None else b.data_ptr(),
                                      out.data_ptr(), n, m, n, k, nt) == 0
    assert torch.equal(out, _fp32_then_round(x, w, b, k))
    torch.testing.assert_close(out, F.linear(x, w, b), **TOL[torch.bfloat16])


def test_widen_gemm_rounds_once_to_nearest_even():
    # two-term sums whose fp32 value is a bf16 tie, just past one, an overflow and a NaN:
    # the store must round as torch does (1 + 2^-8 -> 1, 1 + 3 * 2^-9 -> 1 + 2^-7, inf, NaN)
    lib = _widen_or_skip()
    big = torch.finfo(torch.bfloat16).max
    cols = [(1.0, 2 ** -8), (1.0, 3 * 2 ** -9), (-1.0, -(2 ** -8)), (1.0 + 2 ** -7, 2 ** -8),
            (big, big), (float("nan"), 1.0), (-big, -big), (3.0, -3.0)]
    w = torch.tensor(cols, dtype=torch.bfloat16)  # [8, 2]: column j sums x . w[j]
    x = torch.ones(2, 2, dtype=torch.bfloat16)
    packed = linear.pack_panels(w)
    out = torch.empty(2, len(cols), dtype=torch.bfloat16)
    assert lib.llmsvc_gemm_bf16_widen(x.data_ptr(), 2, packed.data_ptr(), None, out.data_ptr(), len(cols), 2,
                                      len(cols), 2, 1) == 0
    want = torch.tensor([a + b for a, b in w.float().tolist()]).bfloat16()  # fp32 sums, torch's rounding
    for row in out:
        torch.testing.assert_close(row, want, atol=0, rtol=0, equal_nan=True)
    assert out[0, :4].tolist() == [1.0, 1.0078125, -1.0, 1.015625]
    assert out[0, 4] == float("inf") and out[0, 6] == float("-inf") and out[0, 5].isnan()


def test_widen_gemm_reads_strided_rows_and_rejects_bad_arguments():
    lib = _widen_or_skip()
    g = torch.Generator().manual_seed(3)
    w = torch.randn(70, 40, generator=g).bfloat16()
    packed = linear.pack_panels(w)
    x = torch.randn(9, 53, generator=g).bfloat16()  # rows 53 apart, the first 40 used
    out = torch.full((9, 80), float("nan"), dtype=torch.bfloat16)  # rows 80 apart, 70 written
    assert lib.llmsvc_gemm_bf16_widen(x.data_ptr(), 53, packed.data_ptr(), None, out.data_ptr(), 80, 9, 70, 40, 2) == 0
    assert torch.equal(out[:, :70], _fp32_then_round(x[:, :40].contiguous(), w, None, 40))
    assert out[:, 70:].isnan().all()  # past N: untouched
    bad = torch.empty(packed.numel() + 1, dtype=torch.bfloat16)[1:]  # not 64-byte aligned
    args = (x.data_ptr(), 53, packed.data_ptr(), None, out.data_ptr(), 80, 9, 70, 40, 2)
    for i, v in ((2, bad.data_ptr()), (1, 39), (5, 69), (8, 0)):  # misaligned, lda < K, ldc < N, K = 0
        assert lib.llmsvc_gemm_bf16_widen(*args[:i], v, *args[i + 1:]) == -1, i


def test_bf16_linear_packs_for_the_widening_gemm_here():
    # where it is built (and neither AMX nor AVX512-BF16 is), a bf16 weight is packed in the
    # fp32 panel layout and decode and prefill rows take it through gemm_bf16.c
    lib = _widen_or_skip()
    if lib.llmsvc_gemm_bf16_layout() != 2:
        pytest.skip("AMX or AVX512-BF16 here: bf16 takes the VNNI panels")
    assert linear.bf16_layout() == "panels" and linear.bf16_max_m() == linear.PANEL_MAX_M
    g = torch.Generator().manual_seed(4)
    w = torch.randn(100, 576, generator=g).bfloat16()
    packed = linear.pack(w)
    assert packed.dtype == torch.bfloat16 and torch.equal(packed, linear.pack_panels(w))
    assert packed.data_ptr() % 64 == 0
    for m in (1, 64, 1024):
        x = torch.randn(m, 576, generator=g).bfloat16()
        out = ops.linear(x, w, None, packed)
        assert torch.equal(out, _fp32_then_round(x, w, None, 576)), m
    assert linear.bf16_packable(4096) and not linear.bf16_packable(4097)  # a panel (K * 192 bytes) in L2


_PROBE = """
import torch, torch.nn.functional as F
from kernels import ops
from kernels.cpu_ops import build, linear
lib = build.load()
assert lib.llmsvc_gemm_bf16_widen_supported() == 1 and lib.llmsvc_gemm_bf16_layout() == 2
assert linear.bf16_layout() == "panels"
g = torch.Generator().manual_seed(0)
for n, k in ((50, 35), (1000, 576)):
    w, b = torch.randn(n, k, generator=g).bfloat16(), torch.randn(n, generator=g).bfloat16()
    packed = linear.pack(w)
    wp, bf = linear.pack_panels(w.float()), b.float()
    for m in (1, 7, 300):
        x = torch.randn(m, k, generator=g).bfloat16()
        out = ops.linear(x, w, b, packed)
        ref = torch.empty(m, n)
        xf = x.float()
        assert lib.llmsvc_gemm_f32(xf.data_ptr(), k, wp.data_ptr(), bf.data_ptr(), ref.data_ptr(), n, m, n, k, 2) == 0
        assert torch.equal(out, ref.bfloat16()), (n, k, m)
        torch.testing.assert_close(out.float(), F.linear(x, w, b).float(), atol=5e-2, rtol=2e-2)
print("ok")
"""


@needs_native
def test_widen_gemm_built_without_avx512():
    run_avx2_build_probe(_PROBE)
