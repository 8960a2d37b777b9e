"""The one-pass elementwise ops (kernels/cpu_ops/elementwise.c: RMSNorm, fused add + RMSNorm,
SiLU-and-mul, RoPE, row argmax) against the torch reference, and their dispatch from kernels.ops."""
from __future__ import annotations

import os
import subprocess

import pytest
import torch

from kernels import ops, reference as ref
from kernels.cpu_ops import build, elementwise
from kernel_utils import needs_native

pytestmark = needs_native


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
@pytest.mark.parametrize("t,h", [(1, 64), (7, 576), (300, 200), (0, 64), (3, 203)])
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


@pytest.mark.parametrize("flag", ["-mno-avx512bf16", "-mno-avx512f", "-mno-avx2"])
def test_elementwise_on_cpus_without_the_vector_paths(tmp_path, flag):
    """elementwise.c built for a CPU without AVX512-BF16 (bf16 through the scalar macros and
    bf16.h's integer rounding, or on AVX2 elementwise_avx2.h), without AVX-512 (AVX2's header)
    or without AVX2 (every op through the macros), against the reference: the paths such CPUs
    run, which this machine may not."""
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
