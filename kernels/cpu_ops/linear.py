"""Linear layers on the CPU with pre-packed weights.

`F.linear` on the CPU repacks the whole weight matrix into the GEMM library's blocked
layout on every call; with a decode batch of tens of rows that repacking costs about as
much as the multiply. `pack(weight)` packs once at load and `linear` multiplies the packed
copy:

  fp32  our column panels [ceil(N / 48), K, 48] for `gemm.c` (AVX-512, or AVX2 + FMA, where
        each panel is stored as three [K][16] blocks), which streams the weights at decode
        batch sizes faster than MKL and keeps up with it on prefill steps of the default
        budget; rows beyond PANEL_MAX_M go to F.linear on the original weight.
        Without either ISA or the native library: on Intel CPUs MKL `cblas_sgemm_pack` / `_compute`
        (`mkl::_mkl_reorder_linear_weight`, `mkl::_mkl_linear`), the ops torch's inductor
        uses for frozen weights (faster than F.linear's repacking, docs/cpu-kernels.md); on
        other vendors' CPUs, where MKL takes its generic code path, oneDNN's packed matmul
        (1.2-1.8x MKL's for 1-256 rows on an AVX2 AMD EPYC, parity at 1024)
  bf16  with AMX or AVX512-BF16 and K % 32 == 0: VNNI tile panels [ceil(N / 64), K / 2, 128]
        for `gemm_bf16.c` (AMX tiles, `gemm_amx.c`, up to AMX_MAX_M rows; else AVX512-BF16
        dot products, `gemm_bf16dp.c`, up to DP_MAX_M), F.linear on the original weight
        beyond; with AVX2 + FMA only: the fp32 panel layout in bf16, which gemm.c widens to
        fp32 a panel at a time (in slices of PANEL_MAX_M rows: torch's own bf16 GEMM on such a
        CPU emulates bf16 at a tenth of the fp32 one's speed, and oneDNN has no bf16 there);
        elsewhere oneDNN
        (`mkldnn::_reorder_linear_weight`, `mkldnn::_linear_pointwise`), likewise faster than
        F.linear

GGUF blocks (`pack_gguf_blocks`, for `--quantization gguf`): a GGUF's block-quantized weights
kept as one int8 per weight in the fp32 panel layout plus fp32 scale and offset panels per 16 or
32 inputs, one uint8 blob; gemm.c turns them back into fp32 as it multiplies (`llmsvc_gemm_q8`,
gemm_gguf.h): the fp32 panels' result on the dequantized weight, bit for bit, from ~1/3 the bytes.

Every path packs B independently of the row count M of the input (MKL gets the call's own
M as `prepack_batch_size`); the tests check M = 1 .. 1024, and slices beyond, against F.linear. The packed copy
lives beside the original weight (the embedding and checkpoint-shaped code keep using that),
except that a layer multiplying GGUF blocks drops its fp32 copy (llmsvc/models/layers/gguf.py).
"""
from __future__ import annotations

import functools
import os
from typing import Optional

import torch
import torch.nn.functional as F

from kernels.cpu_ops.build import load

PANEL = 48  # gemm.c's panel width (NR)
# rows up to which gemm.c is used: the default step budget (max_num_batched_tokens), so a
# whole prefill step also runs its layers in one native call (decoder.py). Beyond, the layers
# run one by one: fp32 on F.linear, bf16 panels on slices of PANEL_MAX_M rows.
# Up to this size the panels are within a few percent of MKL on an AMX Intel CPU and ahead of
# it on AMD Zen 4 (figures in docs/cpu-kernels.md).
PANEL_MAX_M = 1024
_PANEL_MAX_K = 4096  # keeps a panel (K * 192 bytes) and its prefetched successor inside L2
AMX_PANEL = 64  # gemm_amx.c's panel width (NP)
# rows up to which gemm_amx.c is used; beyond, F.linear on the original weight (no second
# packed copy): ahead of oneDNN's packed GEMM and F.linear at decode sizes, still ahead of
# F.linear at 256 rows, behind it at 1024 (`python -m benchmarks.gemm --dtype bfloat16`,
# docs/cpu-kernels.md)
AMX_MAX_M = 256
# rows up to which gemm_bf16dp.c is used (AVX512-BF16 without AMX, e.g. AMD Zen 4). Within a
# few percent of oneDNN up to 1024 rows (docs/cpu-kernels.md), so a prefill chunk of up to
# 1024 tokens runs all its layers in one native call (decoder.py) too.
DP_MAX_M = 1024


def enabled() -> bool:
    return os.environ.get("LLMSVC_CPU_KERNELS", "1") not in ("", "0")


def _fp32_ok() -> bool:
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")


def _bf16_ok() -> bool:
    return (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def _onednn_ok() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _intel_cpu() -> bool:
    """MKL dispatches its fast kernels on the vendor string: elsewhere oneDNN packs fp32."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("vendor_id")), "").split(":")[-1].strip() == "GenuineIntel"
    except OSError:
        return True  # unknown: keep MKL, torch's own default


# resolved overloads (None where the library is missing): the per-layer call skips torch.ops' lookup
_mkl_linear = torch.ops.mkl._mkl_linear.default if _fp32_ok() else None
_onednn_linear = torch.ops.mkldnn._linear_pointwise.default if _onednn_ok() else None
_linear_pointwise = _onednn_linear if _bf16_ok() else None
# the fp32 library GEMM where gemm.c does not run: "mkl", "onednn" or None (F.linear)
FP32_LIBRARY = ("mkl" if _mkl_linear is not None and (_intel_cpu() or _onednn_linear is None)
                else "onednn" if _onednn_linear is not None else None)


def _panels_ok() -> bool:
    lib = load()
    return lib is not None and lib.llmsvc_gemm_f32_supported() == 1


@functools.cache
def bf16_layout() -> str:
    """The bf16 weight layout gemm_bf16.c reads on this CPU: "vnni" (pack_amx, for AMX tiles or
    AVX512-BF16 dot products), "panels" (pack_panels in bf16, widened to fp32 by gemm.c: AVX-512F
    or AVX2 + FMA without either) or "" (no native bf16 GEMM built)."""
    lib = load()
    return {1: "vnni", 2: "panels"}.get(lib.llmsvc_gemm_bf16_layout() if lib is not None else 0, "")


def bf16_packable(k: int) -> bool:
    """Whether a bf16 weight with k input features gets gemm_bf16.c's packed panels."""
    layout = bf16_layout()
    return (layout == "vnni" and k % 32 == 0) or (layout == "panels" and k <= _PANEL_MAX_K)


@functools.cache
def has_amx() -> bool:
    """Whether gemm_bf16.c runs AMX tiles here (else AVX512-BF16 dot products, if built)."""
    lib = load()
    return lib is not None and lib.llmsvc_gemm_bf16_amx_supported() == 1


def bf16_max_m() -> int:
    """Rows up to which bf16 packed panels go to gemm_bf16.c (beyond: F.linear)."""
    return AMX_MAX_M if has_amx() else DP_MAX_M if bf16_layout() == "vnni" else PANEL_MAX_M


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """t, or a contiguous copy of it whose data starts on a 64-byte boundary."""
    if t.data_ptr() % 64 == 0:
        return t
    buf = torch.empty(t.numel() + 64 // t.element_size(), dtype=t.dtype)
    off = (-buf.data_ptr() // t.element_size()) % (64 // t.element_size())
    return buf[off:off + t.numel()].view(t.shape).copy_(t)


def pack_amx(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] bf16, K % 32 == 0 -> [ceil(N / 64), K / 2, 128]: panel p, K block kb,
    column tile j is the VNNI tile [16 pairs][16 columns][2] of W[64p + 16j + c, 32kb + 2r + e],
    zero-padded past N, 64-byte aligned."""
    n, k = weight.shape
    np_ = -(-n // AMX_PANEL)
    w = F.pad(weight, (0, 0, 0, np_ * AMX_PANEL - n)) if np_ * AMX_PANEL != n else weight
    # [np, j, c, kb, r, e] -> [np, kb, j, r, c, e]
    out = w.view(np_, 4, 16, k // 32, 16, 2).permute(0, 3, 1, 4, 2, 5).contiguous()
    return _aligned(out.view(np_, k // 2, 2 * AMX_PANEL))


def pack_panels(weight: torch.Tensor, subpanel: Optional[int] = None) -> torch.Tensor:
    """weight [N, K] fp32 (or bf16, for gemm.c's widening bf16 entry) -> [ceil(N / 48), K, 48]:
    panel p holds W[48p : 48p + 48, :]^T, zero-padded past N, 64-byte aligned. Each panel is
    stored as 48 / subpanel blocks [K][subpanel] (column block j: W[48p + subpanel j + c, k] at
    [j][k][c]); subpanel None asks the built gemm.c (16 on AVX2, where each pass of its
    micro-kernel reads one block; 48 on AVX-512, plain [K][48])."""
    n, k = weight.shape
    sub = subpanel or load().llmsvc_gemm_f32_subpanel()
    if sub not in (16, 48):
        raise ValueError(f"gemm.c sub-panel width {sub} (the library is not built for this CPU?)")
    np_ = -(-n // PANEL)
    w = F.pad(weight, (0, 0, 0, np_ * PANEL - n)) if np_ * PANEL != n else weight
    # [np, j, c, K] -> [np, j, K, c]; torch's CPU allocator aligns to 64, _aligned keeps the contract
    blocks = w.view(np_, PANEL // sub, sub, k).transpose(2, 3).contiguous()
    return _aligned(blocks.view(np_, k, PANEL))


GGUF_HEADER = 64  # gemm_gguf.h's blob header: int32 weights per scale, then padding


def pack_gguf_blocks(qweight: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> Optional[torch.Tensor]:
    """qweight [N, K] int8, scale and offset [N, K / bs] fp32 with bs = 16 or 32 weights per
    scale (W = scale * q + offset) -> one 64-byte aligned uint8 blob for llmsvc_gemm_q8
    (gemm_gguf.h): a header holding bs, the int8 panels [ceil(N / 48), K, 48], then the scale
    and the offset panels [ceil(N / 48), K / bs, 48], each in pack_panels' layout. None where
    gemm.c is not built (the caller keeps the fp32 path) or the shapes do not fit."""
    n, k = qweight.shape
    bs = k // scale.shape[1] if scale.dim() == 2 and scale.shape[1] else 0
    if (not enabled() or qweight.dtype != torch.int8 or bs not in (16, 32) or k % bs or k > _PANEL_MAX_K
            or scale.shape != (n, k // bs) or offset.shape != scale.shape or not _panels_ok()):
        return None
    header = torch.zeros(GGUF_HEADER, dtype=torch.uint8)
    header[:4] = torch.tensor([bs], dtype=torch.int32).view(torch.uint8)
    parts = [pack_panels(t.contiguous()).reshape(-1).view(torch.uint8)
             for t in (qweight, scale.float(), offset.float())]
    return _aligned(torch.cat([header, *parts]))


def pack(weight: torch.Tensor) -> Optional[torch.Tensor]:
    """weight [N, K] fp32 or bf16 on the CPU -> packed copy (fp32 or AMX panels: 3-D; MKL /
    oneDNN: opaque), or None when packing does not apply (other dtype or device, library missing,
    LLMSVC_CPU_KERNELS=0)."""
    if weight.device.type != "cpu" or weight.dim() != 2 or not enabled():
        return None
    if weight.dtype == torch.float32 and weight.shape[1] <= _PANEL_MAX_K and _panels_ok():
        return pack_panels(weight.contiguous())
    if weight.dtype == torch.float32 and FP32_LIBRARY == "mkl":
        return torch.ops.mkl._mkl_reorder_linear_weight(weight.contiguous(), 64)
    if weight.dtype == torch.float32 and FP32_LIBRARY == "onednn":
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 64)
    if weight.dtype == torch.bfloat16 and bf16_packable(weight.shape[1]):
        w = weight.contiguous()
        return pack_amx(w) if bf16_layout() == "vnni" else pack_panels(w)
    if weight.dtype == torch.bfloat16 and _linear_pointwise is not None:
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 64)
    return None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
           packed: torch.Tensor) -> torch.Tensor:
    """x: [M, K] (or [..., K]) -> [M, N]; F.linear(x, weight, bias) up to summation order."""
    m = x.numel() // x.shape[-1]
    dt = weight.dtype
    if packed.dtype == torch.uint8:  # GGUF blocks: `weight` gives the shape only (it may be on meta)
        return _gguf_linear(x, packed, bias, weight, m)
    if m == 0 or x.dtype != dt:
        return F.linear(x, weight, bias)
    if dt == torch.float32:
        if packed.dim() == 3:  # beyond PANEL_MAX_M the library GEMM keeps up (7-11% ahead at 2048)
            return _gemm_panels(x, packed, bias, weight) if m <= PANEL_MAX_M else F.linear(x, weight, bias)
        if FP32_LIBRARY == "mkl":  # pack() chose by the same flag (both packed kinds are is_mkldnn)
            return _mkl_linear(x, packed, weight, bias, m)
        return _onednn_linear(x, packed, bias, "none", [], "")
    if packed.dim() == 3:
        if m <= bf16_max_m():
            return _gemm_bf16(x, packed, bias, weight)
        if bf16_layout() == "vnni":  # AMX or AVX512-BF16: oneDNN has the same arithmetic beyond
            return F.linear(x, weight, bias)
        # widened panels: the CPU has no bf16 arithmetic and torch's bf16 GEMM emulates it at a
        # tenth of the panels' speed, so longer steps are multiplied in slices of the panels' limit
        return _in_row_slices(lambda xs: _gemm_bf16(xs, packed, bias, weight), x, bf16_max_m())
    return _linear_pointwise(x, packed, bias, "none", [], "")


def _in_row_slices(gemm, x: torch.Tensor, rows: int) -> torch.Tensor:
    """gemm(x) for x [..., K], run on slices of at most `rows` rows of x: each output row depends
    on its own input row alone, so the result is the one call's bit for bit."""
    m = x.numel() // x.shape[-1]
    if m <= rows:
        return gemm(x)
    x2 = x.reshape(-1, x.shape[-1])
    out = torch.cat([gemm(x2[i:i + rows]) for i in range(0, m, rows)])
    return out.view(*x.shape[:-1], out.shape[-1])


def _native(entry, x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor],
            weight: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ weight^T through a native packed GEMM `entry` (gemm.c / gemm_bf16.c)."""
    n, k = weight.shape
    flat = x.dim() == 2  # the model's case; reshape and view cost ~3 us each per call
    x2 = x if flat else x.reshape(-1, k)
    if x2.stride(-1) != 1 or (bias is not None and (bias.dtype != x.dtype or not bias.is_contiguous())):
        return F.linear(x, weight, bias)
    m = x2.shape[0]
    out = torch.empty((m, n), dtype=x.dtype)
    rc = entry(x2.data_ptr(), x2.stride(0), packed.data_ptr(), None if bias is None else bias.data_ptr(),
               out.data_ptr(), n, m, n, k, torch.get_num_threads())
    if rc != 0:
        raise ValueError("CPU packed GEMM: arguments rejected")
    return out if flat else out.view(*x.shape[:-1], n)


def _gguf_linear(x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor], weight: torch.Tensor,
                 m: int) -> torch.Tensor:
    """x [..., K] fp32 @ GGUF blocks: llmsvc_gemm_q8, PANEL_MAX_M rows at a time (each row's sums
    do not depend on the others)."""
    n, k = weight.shape
    if x.dtype != torch.float32:
        raise ValueError(f"GGUF blocks multiply float32 activations, not {x.dtype}")
    if m == 0:
        return x.new_empty((*x.shape[:-1], n))
    x2 = x.reshape(-1, k)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()  # _native's F.linear fallback has no weight here
    bias = None if bias is None else bias.float().contiguous()
    entry = load().llmsvc_gemm_q8
    out = _in_row_slices(lambda xs: _native(entry, xs, packed, bias, weight), x2, PANEL_MAX_M)
    return out.view(*x.shape[:-1], n)


def _gemm_panels(x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor],
                 weight: torch.Tensor) -> torch.Tensor:
    return _native(load().llmsvc_gemm_f32, x, packed, bias, weight)


def _gemm_bf16(x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor],
              weight: torch.Tensor) -> torch.Tensor:
    return _native(load().llmsvc_gemm_bf16, x, packed, bias, weight)
