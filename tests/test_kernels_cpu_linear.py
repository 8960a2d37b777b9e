"""The packed linear layers (kernels/cpu_ops/linear) against F.linear for every batch size class:
the fp32 panel GEMM and its packing, the library GEMM beside it, and rows past the native limit."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import ops
from kernels.cpu_ops import build, isa, linear
from kernel_utils import TOL, needs_native

pytestmark = needs_native


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 3, 4, 5, 11, 16, 64, 200, 300, 1024])  # 4-6 row blocks: asm
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
        parts = torch.cat([native(linear.load().llmsvc_gemm_bf16, x[i:i + limit], packed, b, w)
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
