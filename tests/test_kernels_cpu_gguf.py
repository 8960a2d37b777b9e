"""gemm.c's GGUF-block GEMM (llmsvc_gemm_q8) against the fp32 panel GEMM on the dequantized
weight (bit for bit: the same products and sums) and against its torch reference."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import ops
from kernels import reference as ref
from kernels.cpu_ops import build, linear
from kernel_utils import needs_native, run_avx2_build_probe


def _blocks(n, k, g, kind="Q4_1"):
    """Random blocks as a GGUF type holds them: fp16 scales (and offsets), q in its range;
    Q6_K: 16-weight blocks whose scale is an fp16 times an int8 sub-scale (d * sc * q rounds)."""
    lo, hi, bs = {"Q4_0": (-8, 8, 32), "Q4_1": (0, 16, 32), "Q8_0": (-128, 128, 32), "Q6_K": (-32, 32, 16)}[kind]
    q = torch.randint(lo, hi, (n, k), generator=g, dtype=torch.int8)
    d = (torch.rand(n, k // bs, generator=g) * 0.02).half().float()
    if kind == "Q6_K":
        d = (d / 128).half().float() * torch.randint(-128, 128, d.shape, generator=g).float()
    m = (torch.randn(n, k // bs, generator=g) * 0.05).half().float() if kind == "Q4_1" else torch.zeros_like(d)
    return q, d, m


def _close(got, x, w, want):
    """fp32 sums in another order: the bound scales with sum |x||w| (1e-6 of it, ~8 ulps), not
    with the result, which cancels."""
    atol = 1e-6 * float((x.reshape(-1, x.shape[-1]).abs() @ w.abs().t()).max())
    torch.testing.assert_close(got, want, atol=max(atol, 1e-5), rtol=1e-4)


def _needs_panels():
    lib = build.load()
    if lib is None or lib.llmsvc_gemm_f32_supported() != 1:
        pytest.skip("gemm.c's panels are not built on this CPU (neither AVX-512F nor AVX2 + FMA)")
    return lib


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0", "Q6_K"])
@pytest.mark.parametrize("n,k", [(48, 32), (50, 64), (100, 576), (1000, 1536)])
def test_gguf_gemm_is_the_fp32_gemm_on_the_dequantized_weight(kind, n, k):
    lib = _needs_panels()
    g = torch.Generator().manual_seed(n + k)
    q, d, m = _blocks(n, k, g, kind)
    w = ref.dequantize_gguf_blocks(q, d, m)
    blob, panels = ops.pack_gguf_blocks(q, d, m), linear.pack(w)
    assert blob.dtype == torch.uint8 and blob.data_ptr() % 64 == 0
    bs = 16 if kind == "Q6_K" else 32
    assert int(blob[:4].view(torch.int32)) == bs
    assert blob.numel() == 64 + -(-n // 48) * 48 * (k + 2 * 4 * k // bs)  # header, int8 panels, two fp32 panels
    b = torch.randn(n, generator=g)
    # 1-16 rows: dequantized in registers, 4 rows at a time; beyond: once per panel into a buffer
    # (260: a chunk of 256 through the buffer, then 4 rows in registers)
    for rows in (1, 3, 4, 5, 6, 13, 16, 17, 64, 260, 300):
        x = torch.randn(rows, k, generator=g)
        for bias in (None, b):
            got = ops.linear(x, w, bias, blob)
            assert torch.equal(got, ops.linear(x, w, bias, panels)), (rows, bias is None)
            _close(got, x, w, F.linear(x, w, bias))
        for nt in (1, 3):  # thread counts that do not divide the panels evenly
            out = torch.full((rows, n), float("nan"))
            assert lib.llmsvc_gemm_q8(x.data_ptr(), k, blob.data_ptr(), b.data_ptr(), out.data_ptr(), n,
                                      rows, n, k, nt) == 0
            _close(out, x, w, F.linear(x, w, b))


def test_gguf_gemm_takes_strided_rows_and_rejects_what_it_cannot_read():
    lib = _needs_panels()
    g = torch.Generator().manual_seed(1)
    q, d, m = _blocks(100, 576, g)
    w, blob = ref.dequantize_gguf_blocks(q, d, m), ops.pack_gguf_blocks(q, d, m)
    x = torch.randn(2, 5, 576, generator=g)[:, 1:]  # [2, 4, 576], rows strided
    _close(ops.linear(x, w, None, blob), x, w, F.linear(x, w))
    out = torch.empty(1, 100)
    bad = torch.empty(blob.numel() + 1, dtype=torch.uint8)[1:]  # not 64-byte aligned
    assert lib.llmsvc_gemm_q8(x.data_ptr(), 576, bad.data_ptr(), None, out.data_ptr(), 100, 1, 100, 576, 1) == -1
    assert lib.llmsvc_gemm_q8(x.data_ptr(), 576, blob.data_ptr(), None, out.data_ptr(), 100, 1, 100, 560, 1) == -1
    assert linear.pack_gguf_blocks(q[:, :40], d[:, :1], m[:, :1]) is None  # K not whole blocks
    assert linear.pack_gguf_blocks(q.float(), d, m) is None  # not int8


_AVX2_PROBE = """
import torch, torch.nn.functional as F
from kernels import reference as ref
from kernels.cpu_ops import build, linear
assert build.load().llmsvc_gemm_f32_subpanel() == 16
g = torch.Generator().manual_seed(0)
for n, k, bs in ((48, 32, 32), (50, 64, 16), (1000, 1536, 32)):
    q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    d = (torch.rand(n, k // bs, generator=g) * 0.02).half().float()
    m = (torch.randn(n, k // bs, generator=g) * 0.05).half().float()
    w = ref.dequantize_gguf_blocks(q, d, m)
    blob, panels = linear.pack_gguf_blocks(q, d, m), linear.pack(w)
    b = torch.randn(n, generator=g)
    for rows in (1, 4, 5, 16, 17, 300):
        x = torch.randn(rows, k, generator=g)
        got = linear.linear(x, w, b, blob)
        assert torch.equal(got, linear.linear(x, w, b, panels)), (n, k, rows)
        # fp32 sums in another order: the bound scales with sum |x||w| (see _close)
        atol = max(1e-5, 1e-6 * float((x.abs() @ w.abs().t()).max()))
        torch.testing.assert_close(got, F.linear(x, w, b), atol=atol, rtol=1e-4)
print("ok")
"""


@needs_native
def test_gguf_gemm_built_for_avx2(tmp_path):
    """The same, as an AVX2 CPU without AVX-512 runs it (three [K][16] sub-panels)."""
    run_avx2_build_probe(_AVX2_PROBE)
