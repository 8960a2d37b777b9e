"""int8 linear layers on the CPU (`--quantization int8`): weights quantized once at load, per
output channel; activations per token at run time (kernels/reference_int8.py has the rule).

`pack(weight)` quantizes and packs a weight into one 64-byte aligned int8 blob, the only thing
the layer keeps:

  header  64 bytes: int32 MAGIC, N, K, Kp (K rounded up to KQ), qmax (|q_w| <= qmax), then zeros
  panels  [ceil(N / NP), Kp / 4, NP, 4] int8: panel p, k-quad g, column c, byte e holds
          q_w[NP p + c, 4 g + e], zero past N and K. A k-quad row of a panel is 64 bytes (one
          cache line): one zmm for AVX512-VNNI (vpdpbusd's 4 bytes per int32 lane), two ymm
          for AVX-VNNI and AVX2_W7, four ymm of int16 pairs for AVX2, and 16 of them are one AMX
          B tile
  scales  [ceil(N / NP) * NP] fp32: s_w per column (0 past N)
  colsums [ceil(N / NP) * NP] int32: sum_k q_w[n, k], which undoes the +128 offset the u8
          paths' unsigned activations add (sum (q_a + 128) q_w = sum q_a q_w + 128 colsum)
  smooth  [Kp] fp32: 1 / f[k], SmoothQuant's factor (reference_int8.smoothing), by which each
          activation is multiplied before it is quantized; 1 without smoothing, 0 past K

`linear(x, packed, bias)` is the one dispatch point: the native GEMM (gemm_int8.c, on the
best ISA this CPU has, or the one LLMSVC_INT8_ISA names) or, where none is built, the torch
reference on the unpacked weight. Both give the reference's integer sums exactly.

The weights' range is the path's (`weight_qmax`): +-127, except on `avx2_w7`, the fastest path
on a CPU with AVX2 but no VNNI (Haswell to Skylake-SP, Zen 1 to 3). Its vpmaddubsw adds two
u8 x s8 products in int16, which holds 255 * 64 * 2 but not 255 * 127 * 2, so its blobs are
quantized to +-64: 1.25-1.33x the int16 path's speed from 16 rows for one bit of weight
precision (docs/cpu-kernels.md has the quality cost). `LLMSVC_INT8_ISA=avx2` keeps 8-bit
weights on such a CPU.
"""
from __future__ import annotations

import functools
import os
from typing import Optional

import torch

from kernels import reference_int8 as _ref
from kernels.cpu_ops.build import DTYPE_CODES, load
from kernels.cpu_ops.linear import _aligned

NP = 16  # columns per panel
KQ = 64  # K is padded to this: one AMX tile row of int8 (16 k-quads)
HEADER = 64
MAGIC = 0x38544E49  # "INT8"
# gemm_int8.c's ISA codes, slowest first; "ref" is the torch reference
ISAS = ("ref", "avx2", "avx2_w7", "avxvnni", "avx512vnni", "amx")


def _layout(n: int, k: int) -> tuple[int, int]:
    """(panel count, padded K) of an [n, k] weight."""
    return -(-n // NP), -(-k // KQ) * KQ


@functools.cache
def exact_qmax(path: str) -> int:
    """The widest weight range (|q_w| <= this) path multiplies exactly: reference_int8.QMAX for
    the reference, else gemm_int8.h's for that ISA (64 for avx2_w7), asked of the library."""
    lib = load() if path != "ref" else None
    return _ref.QMAX if lib is None else int(lib.llmsvc_gemm_i8_qmax(ISAS.index(path)))


def weight_qmax(path: Optional[str] = None) -> int:
    """The weight range that blobs for path (None: `isa()`) are packed with: the widest it
    multiplies exactly. "ref", which multiplies any, takes the range of this CPU's fastest native
    path, so that LLMSVC_INT8_ISA=ref reproduces that path's tokens."""
    path = path or isa()
    if path == "ref":
        native = _native_isas()
        path = native[-1] if native else path
    return exact_qmax(path)


def pack(weight: torch.Tensor, smooth: Optional[torch.Tensor] = None, qmax: Optional[int] = None) -> torch.Tensor:
    """weight [N, K] float on the CPU -> the int8 blob of the module docstring. smooth: f [K]
    (reference_int8.smoothing): W f is quantized, and activations are divided by f at run time.
    qmax: the weights' range (default `weight_qmax()`, what this CPU's path multiplies)."""
    n, k = weight.shape
    qmax = weight_qmax() if qmax is None else int(qmax)
    if not 1 <= qmax <= _ref.QMAX:
        raise ValueError(f"int8 weights: qmax must be 1..{_ref.QMAX}, not {qmax}")
    inv = torch.ones(k) if smooth is None else 1.0 / smooth.float()
    q, scale = _ref.quantize_weight(weight if smooth is None else weight.float() * smooth, qmax)
    np_, kp = _layout(n, k)
    qp = torch.zeros(np_ * NP, kp, dtype=torch.int8)
    qp[:n, :k] = q
    panels = qp.view(np_, NP, kp // 4, 4).permute(0, 2, 1, 3).contiguous()  # [np, Kp/4, NP, 4]
    scales = torch.zeros(np_ * NP, dtype=torch.float32)
    scales[:n] = scale
    colsums = torch.zeros(np_ * NP, dtype=torch.int32)
    colsums[:n] = q.sum(dim=1, dtype=torch.int32)
    header = torch.zeros(HEADER // 4, dtype=torch.int32)
    header[:5] = torch.tensor([MAGIC, n, k, kp, qmax], dtype=torch.int32)
    smooth_inv = torch.zeros(kp, dtype=torch.float32)
    smooth_inv[:k] = inv
    parts = [header.view(torch.int8), panels.view(-1), scales.view(torch.int8), colsums.view(torch.int8),
             smooth_inv.view(torch.int8)]
    return _aligned(torch.cat(parts))


def is_packed(packed: Optional[torch.Tensor]) -> bool:
    return (packed is not None and packed.dtype == torch.int8 and packed.dim() == 1
            and packed.numel() >= HEADER and int(packed[:4].view(torch.int32)[0]) == MAGIC)


def _header(packed: torch.Tensor) -> tuple[int, int, int]:
    """(N, K, qmax) of a blob, in one read of its header."""
    _, n, k, _, qmax = packed[:20].view(torch.int32).tolist()
    return n, k, qmax


def shape(packed: torch.Tensor) -> tuple[int, int]:
    """(N, K) of a blob."""
    return _header(packed)[:2]


def qmax_of(packed: torch.Tensor) -> int:
    """The weight range a blob was quantized to."""
    return _header(packed)[2]


def unpack(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """blob -> (q_w [N, K] int8, s_w [N] fp32, 1 / f [K] fp32), as pack made them."""
    n, k = shape(packed)
    np_, kp = _layout(n, k)
    size = np_ * NP * kp
    panels = packed[HEADER:HEADER + size].view(np_, kp // 4, NP, 4)
    q = panels.permute(0, 2, 1, 3).reshape(np_ * NP, kp)[:n, :k]
    scales = packed[HEADER + size:HEADER + size + 4 * np_ * NP].view(torch.float32)[:n]
    at = HEADER + size + 8 * np_ * NP
    smooth_inv = packed[at:at + 4 * kp].view(torch.float32)[:k]
    return q, scales, smooth_inv


def weight_bytes(packed: torch.Tensor) -> int:
    """Bytes a multiply reads: the whole blob."""
    return packed.numel()


@functools.cache
def _native_isas() -> tuple[str, ...]:
    """The ISA paths the built library runs on this CPU (runtime detection in gemm_int8.c)."""
    lib = load()
    if lib is None:
        return ()
    return tuple(name for code, name in enumerate(ISAS) if code and lib.llmsvc_gemm_i8_supported(code) == 1)


def available_isas() -> tuple[str, ...]:
    """Every path this machine can run, the reference first: what the tests compare."""
    return ("ref", *_native_isas())


def isa() -> str:
    """The path `linear` takes: LLMSVC_INT8_ISA if set (ValueError when this CPU or build
    cannot run it), else the fastest native one, else "ref"."""
    forced = os.environ.get("LLMSVC_INT8_ISA", "")
    if forced:
        if forced not in available_isas():
            raise ValueError(f"LLMSVC_INT8_ISA={forced!r}: this CPU / build runs {', '.join(available_isas())}")
        return forced
    native = _native_isas()
    return native[-1] if native else "ref"


def linear(x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor] = None,
           path: Optional[str] = None) -> torch.Tensor:
    """x [..., K] fp32 or bf16 -> [..., N] in x's dtype: reference_int8.int8_linear on the
    blob's weight. path: one of available_isas() (None: `isa()`)."""
    path = path or isa()
    n, k, qmax = _header(packed)  # one header read per call: this is every per-op int8 layer's path
    if x.shape[-1] != k:
        raise ValueError(f"int8 linear: input has {x.shape[-1]} features, the weight {k}")
    if qmax > exact_qmax(path):
        raise ValueError(f"int8 linear ({path}): weights quantized to +-{qmax}, this path multiplies "
                         f"+-{exact_qmax(path)} exactly (pack with qmax={exact_qmax(path)})")
    if path == "ref" or x.dtype not in DTYPE_CODES:
        q, s, inv = unpack(packed)
        return _ref.int8_linear(x, q, s, bias, inv)
    x2 = x.reshape(-1, k)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    m = x2.shape[0]
    out = torch.empty((m, n), dtype=x.dtype)
    if m:
        b = None if bias is None else bias.to(x.dtype).contiguous()
        rc = load().llmsvc_gemm_i8(ISAS.index(path), x2.data_ptr(), x2.stride(0), DTYPE_CODES[x.dtype],
                                   packed.data_ptr(), None if b is None else b.data_ptr(), out.data_ptr(),
                                   n, m, n, k, torch.get_num_threads())
        if rc != 0:
            raise ValueError(f"int8 GEMM ({path}): arguments rejected")
    return out.view(*x.shape[:-1], n)
