"""The int8 GEMM (`--quantization int8`): every path this CPU runs against the torch reference.

kernels/reference_int8.py defines the result; each native path (AVX2, AVX-VNNI, AVX512-VNNI,
AMX-INT8: whichever cpuid and the OS grant here, kernels/cpu_ops/int8.available_isas) must give
its integer sums exactly, so in fp32 the outputs agree to the epilogue's last place (a fused
multiply-add, the order of the two scale multiplies) and in bf16 to one bf16 rounding step.
A single activation or weight quantized one step off moves an output by ~1e-3 of its size,
a thousand times the fp32 tolerance.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from kernels import reference_int8 as ref
from kernels.cpu_ops import int8
from kernels.cpu_ops.build import load

NATIVE = int8.available_isas()[1:]
needs_native = pytest.mark.skipif(not NATIVE, reason="no native int8 GEMM runs on this CPU / build")

# M: 1, each ISA's row block (3, 6, 8, 16, AMX's 16-row tiles up to 64) and one past it, the
# driver's 96- and 128-row blocks and past; K and N: multiples of the 64 / 16 padding and not
SHAPES = [(1, 64, 16), (1, 576, 960), (2, 70, 50), (3, 130, 33), (4, 576, 1536), (7, 1536, 576),
          (9, 200, 17), (16, 64, 48), (17, 100, 31), (33, 96, 40), (64, 576, 80), (95, 576, 64),
          (97, 130, 100), (130, 200, 48), (200, 576, 192)]


def _close(y: torch.Tensor, r: torch.Tensor) -> None:
    if r.dtype == torch.float32:
        torch.testing.assert_close(y, r, rtol=2e-6, atol=2e-6 * float(r.abs().max()))
    else:  # one bf16 step (2^-8 relative) from an fp32 value that straddles a rounding point
        torch.testing.assert_close(y.float(), r.float(), rtol=2 ** -7, atol=1e-6)


def test_quantize_rows_is_symmetric_per_row_and_within_127():
    x = torch.tensor([[0.5, -1.0, 0.25, 0.0], [0.0, 0.0, 0.0, 0.0], [3.0, 1.0, -2.0, 1.5]])
    q, s = ref.quantize_rows(x)
    assert q.dtype == torch.int8 and q.abs().max() <= 127
    assert q[0].tolist() == [64, -127, 32, 0] and q[1].tolist() == [0, 0, 0, 0] and s[1] == 0
    assert q[2, 0] == 127 and torch.allclose(s, torch.tensor([1.0, 0.0, 3.0]) / 127)


@pytest.mark.parametrize("qmax", [127, 64])
@pytest.mark.parametrize("n,k", [(16, 64), (50, 70), (33, 130)])
def test_pack_keeps_the_quantized_weight_and_its_scales(n, k, qmax):
    w = torch.randn(n, k)
    blob = int8.pack(w, qmax=qmax)
    assert blob.dtype == torch.int8 and blob.data_ptr() % 64 == 0 and int8.shape(blob) == (n, k)
    assert int8.qmax_of(blob) == qmax
    q, s, inv = int8.unpack(blob)
    q_ref, s_ref = ref.quantize_weight(w, qmax)
    amax = w.abs().amax(1)
    assert int(q.abs().max()) == qmax and bool(((s <= amax / qmax) & (s >= 0.6 * amax / qmax)).all())
    assert torch.equal(q, q_ref) and torch.equal(s, s_ref) and torch.equal(inv, torch.ones(k))
    np_, kp = -(-n // 16), -(-k // 64) * 64
    colsums = blob[64 + np_ * 16 * kp + 64 * np_:].view(torch.int32)[:n]
    assert torch.equal(colsums, q_ref.sum(1, dtype=torch.int32))


@pytest.mark.parametrize("qmax", [127, 64])
def test_weight_scales_clip_the_largest_weight_where_that_lowers_the_error(qmax):
    """Per row, the scale is the clipping ratio with the least squared error. Row 0's weights lie
    on the grid of ratio 0.95 but for its largest, 1.0, which that grid clips to 0.95: plain max
    scaling would round every other weight. Row 1 (equal magnitudes) keeps the plain scale."""
    on_grid = torch.arange(-qmax + 4, qmax - 4).float().repeat(8) * 0.95 / qmax
    w = torch.stack([torch.cat([torch.tensor([1.0]), on_grid]), torch.full((on_grid.numel() + 1,), -0.5)])
    q, s = ref.quantize_weight(w, qmax)
    plain = w.abs().amax(1) / qmax
    torch.testing.assert_close(s, torch.stack([0.95 * plain[0], plain[1]]))
    assert q[0, 0] == qmax and torch.equal(q[0, 1:].float(), torch.arange(-qmax + 4, qmax - 4).float().repeat(8))
    err = ((q.float() * s[:, None] - w) ** 2).sum(1)
    err_plain = ((torch.round(w / plain[:, None]) * plain[:, None] - w) ** 2).sum(1)
    assert err[0] < 0.5 * err_plain[0]
    zero_q, zero_s = ref.quantize_weight(torch.zeros(2, 64), qmax)
    assert not zero_q.any() and not zero_s.any()


def test_reference_is_close_to_the_float_product():
    """int8 steps are 1/127 of a row's largest magnitude: on Gaussian data the product's error
    is a fraction of a percent of its scale."""
    torch.manual_seed(0)
    x, w = torch.randn(8, 576), torch.randn(300, 576) * 0.05
    q, s = ref.quantize_weight(w)
    y = ref.int8_linear(x, q, s)
    err = (y - x @ w.t()).abs().max() / (x @ w.t()).abs().max()
    assert err < 0.02


@needs_native
@pytest.mark.parametrize("path", NATIVE)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,k,n", SHAPES)
def test_native_path_equals_reference(path, dtype, m, k, n):
    g = torch.Generator().manual_seed(m * 1000 + k + n)
    w = torch.randn(n, k, generator=g) * 0.05
    smooth = None if m % 2 else torch.rand(k, generator=g) + 0.5  # every other shape smoothed
    blob = int8.pack(w, smooth, qmax=int8.weight_qmax(path))
    x = (torch.randn(m, k, generator=g) * 2).to(dtype)
    x[0, :3] = 0  # zeros and a row whose max sits anywhere: both ends of the range
    bias = torch.randn(n, generator=g).to(dtype)
    for b in (bias, None):
        _close(int8.linear(x, blob, b, path=path), int8.linear(x, blob, b, path="ref"))


def test_smoothing_moves_an_outlier_channel_into_the_weight():
    """One input channel 100x the others: per-row quantization leaves the rest a few int8 steps;
    SmoothQuant's factors (from that channel's calibration range) restore the precision."""
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(16, 256, generator=g), torch.randn(64, 256, generator=g) * 0.05
    x[:, 7] *= 100
    exact = x @ w.t()
    f = ref.smoothing(x.abs().amax(0), w)
    plain = int8.linear(x, int8.pack(w), path="ref")
    smooth_blob = int8.pack(w, f)
    smoothed = int8.linear(x, smooth_blob, path="ref")
    assert (smoothed - exact).norm() < 0.5 * (plain - exact).norm()
    assert torch.allclose(int8.unpack(smooth_blob)[2], 1 / f)
    for path in NATIVE:
        _close(int8.linear(x, smooth_blob, path=path), smoothed)
        _close(int8.linear(x.bfloat16(), smooth_blob, path=path), int8.linear(x.bfloat16(), smooth_blob, path="ref"))


@needs_native
@pytest.mark.parametrize("path", NATIVE)
def test_strided_rows_zero_rows_and_3d_inputs(path):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(40, 96, generator=g)
    blob = int8.pack(w)
    big = torch.randn(5, 200, generator=g)
    x = big[:, 10:106]  # row stride 200
    x[2] = 0  # an all-zero row: scale 0, output = bias
    bias = torch.randn(40, generator=g)
    y = int8.linear(x, blob, bias, path=path)
    _close(y, int8.linear(x.contiguous(), blob, bias, path="ref"))
    assert torch.equal(y[2], bias)
    x3 = torch.randn(2, 3, 96, generator=g)
    _close(int8.linear(x3, blob, None, path=path), int8.linear(x3, blob, None, path="ref"))
    assert int8.linear(torch.empty(0, 96), blob, None, path=path).shape == (0, 40)


@needs_native
def test_native_rejects_a_blob_of_another_shape():
    blob = int8.pack(torch.randn(32, 64))
    lib = load()
    x, out = torch.randn(2, 64), torch.empty(2, 48)
    rc = lib.llmsvc_gemm_i8(int8.ISAS.index(NATIVE[0]), x.data_ptr(), 64, 0, blob.data_ptr(), None,
                            out.data_ptr(), 48, 2, 48, 64, 1)
    assert rc == -1
    with pytest.raises(ValueError, match="features"):
        int8.linear(torch.randn(2, 65), blob)


@needs_native
@pytest.mark.parametrize("path", NATIVE)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_widest_products_do_not_saturate(path, dtype):
    """Every weight at +-qmax and every activation at a row's maximum: the largest partial sums
    a path forms (avx2_w7: 255 * 64 * 2 = 32640 in an int16) must come out exact. Rows of
    positive, negative and mixed signs, against weights of both signs."""
    qmax, k = int8.weight_qmax(path), 256
    w = torch.ones(32, k)
    w[1::2] = -1
    w[2::4, ::3] = -1
    x = torch.ones(6, k)
    x[1] = -1
    x[2, ::2] = -1
    x[3, 1::4] = 0.5
    blob = int8.pack(w, qmax=qmax)
    assert int(int8.unpack(blob)[0].abs().min()) == qmax
    _close(int8.linear(x.to(dtype), blob, path=path), int8.linear(x.to(dtype), blob, path="ref"))
    exact = int8.linear(x, blob, path=path)
    assert torch.equal(exact[0], (x[0] @ w.t()))  # whole multiples of the scales: exact in fp32


@needs_native
def test_a_path_refuses_weights_wider_than_it_multiplies():
    narrow = [p for p in NATIVE if int8.weight_qmax(p) < ref.QMAX]
    if not narrow:
        pytest.skip("every path here multiplies 8-bit weights")
    blob = int8.pack(torch.randn(16, 64), qmax=ref.QMAX)
    with pytest.raises(ValueError, match=f"qmax={int8.weight_qmax(narrow[0])}"):
        int8.linear(torch.randn(2, 64), blob, path=narrow[0])
    x, out = torch.randn(2, 64), torch.empty(2, 16)
    rc = load().llmsvc_gemm_i8(int8.ISAS.index(narrow[0]), x.data_ptr(), 64, 0, blob.data_ptr(), None,
                               out.data_ptr(), 16, 2, 16, 64, 1)
    assert rc == -1
    assert int8.linear(x, blob, path="ref").shape == (2, 16)  # the reference takes any range


def test_unsupported_isa_is_refused(monkeypatch):
    missing = [p for p in int8.ISAS if p not in int8.available_isas()]
    if missing:
        monkeypatch.setenv("LLMSVC_INT8_ISA", missing[0])
        with pytest.raises(ValueError, match="LLMSVC_INT8_ISA"):
            int8.isa()
        lib = load()
        if lib is not None:
            assert lib.llmsvc_gemm_i8_supported(int8.ISAS.index(missing[0])) == 0
    monkeypatch.setenv("LLMSVC_INT8_ISA", "ref")
    assert int8.isa() == "ref"


def test_every_isa_kernel_is_compiled_in():
    """The VNNI and AMX kernels are built on every x86 machine (target attributes), whatever
    -march=native allows, so a build on an AVX2 box is not missing them; which runs is decided
    at run time."""
    lib = load()
    if lib is None or not hasattr(lib, "i8_kernel_avx512vnni"):
        pytest.skip("no native library, or not an x86-64 build")
    for name in ("i8_kernel_avxvnni", "i8_kernel_avx512vnni", "i8_kernel_amx", "i8_cpu_has"):
        assert hasattr(lib, name)


@needs_native
def test_the_cpu_isa_cap_turns_the_native_paths_off():
    """LLMSVC_CPU_ISA=sse4 (kernels/cpu_ops/isa.py) builds for a CPU without AVX2: the runtime
    detection must not pick a path the cap excludes, and the reference takes over."""
    code = ("import torch; from kernels.cpu_ops import int8; assert int8.available_isas() == ('ref',), "
            "int8.available_isas(); b = int8.pack(torch.randn(8, 64)); print(int8.linear(torch.randn(2, 64), b).shape)")
    env = {**os.environ, "LLMSVC_CPU_ISA": "sse4"}
    env.pop("LLMSVC_INT8_ISA", None)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "torch.Size([2, 8])" in r.stdout
