"""`python -m tests.isa_emulation.gemm_cases OUT SUBPANEL [ENTRY...]`: fp32 and widened-bf16 panel
GEMM calls packed for a gemm.c sub-panel width (16: AVX2, 48: AVX-512), whose layout the host's
build may not run, with torch's float64 products as the expected outputs, in trace.py's format;
and bf16 calls of each ENTRY that takes the VNNI tile layout (llmsvc_gemm_bf16_dp on
AVX512-BF16, llmsvc_gemm_bf16_amx on AMX)."""
from __future__ import annotations

import sys

import torch

from kernels.cpu_ops.linear import pack_amx, pack_panels
from tests.isa_emulation.trace import ARG_I32, ARG_I64, ARG_NULL, ARG_PTR, DTYPE_CODES, encode_call

SHAPES = [(1, 48, 64), (3, 100, 576), (7, 1536, 576), (16, 576, 1536), (33, 192, 576), (100, 96, 64),
          (257, 144, 576)]  # (M, N, K): partial panels, one row, past a 96-row block, past 256


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def case(name: str, x: torch.Tensor, w: torch.Tensor, bias, packed: torch.Tensor) -> bytes:
    m, k = x.shape
    n = w.shape[0]
    want = x.double() @ w.double().T + (0 if bias is None else bias.double())
    ins = [x, packed] + ([] if bias is None else [bias])
    code = DTYPE_CODES[x.dtype]
    storages = [(_bytes(t), _bytes(t), code if t.dtype == x.dtype else 0) for t in ins]
    storages.append((_bytes(torch.zeros(m, n, dtype=x.dtype)), _bytes(want.to(x.dtype)), code))
    # llmsvc_gemm_f32 / _bf16_widen (a, lda, packed, bias, c, ldc, M, N, K, nt)
    args = [(ARG_PTR, 0, 0), (ARG_I64, 0, k), (ARG_PTR, 1, 0),
            (ARG_NULL, 0, 0) if bias is None else (ARG_PTR, 2, 0), (ARG_PTR, len(ins), 0),
            (ARG_I64, 0, n), (ARG_I64, 0, m), (ARG_I64, 0, n), (ARG_I64, 0, k), (ARG_I32, 0, 2)]
    return encode_call(name, 0, args, storages)


def main(out: str, subpanel: int, vnni_entries: tuple[str, ...] = ()) -> None:
    g = torch.Generator().manual_seed(0)
    calls = [(torch.float32, "llmsvc_gemm_f32", False), (torch.bfloat16, "llmsvc_gemm_bf16_widen", False)]
    calls += [(torch.bfloat16, name, True) for name in vnni_entries]
    with open(out, "wb") as f:
        for m, n, k in SHAPES:
            for dtype, name, vnni in calls:
                x = torch.randn(m, k, generator=g).to(dtype)
                w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype)
                bias = torch.randn(n, generator=g).to(dtype) if m % 2 else None
                f.write(case(name, x, w, bias, pack_amx(w) if vnni else pack_panels(w, subpanel)))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), tuple(sys.argv[3:]))
