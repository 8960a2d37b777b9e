"""RMSNorm, fused add + RMSNorm, SiLU-and-mul, neox RoPE and row argmax on the CPU through
the native kernels in `elementwise.c`: one pass over memory per op, where the torch reference runs
4-10 separate ops (each a pass and, at decode batch sizes, a dispatch cost of its own).
Same contracts and rounding as `kernels/reference.py`; fp32 or bf16 storage.
"""
from __future__ import annotations

import torch

from kernels.cpu_ops.build import DTYPE_CODES as _DTYPES, as_c_array, load


def supports(*tensors: torch.Tensor) -> bool:
    """CPU tensors of one dtype (fp32 / bf16), contiguous in the last dim, kernels built.
    On every op call, so kept to plain attribute checks. The device is checked before
    `load()`, so a GPU's ops (its greedy argmax on fp32 logits) never build the CPU library."""
    t0 = tensors[0]
    dt = t0.dtype
    if not t0.is_cpu or dt not in _DTYPES or t0.dim() != 2 or load() is None:
        return False
    for t in tensors:
        if t.dtype != dt or not t.is_cpu or t.stride(-1) != 1:
            return False
    return True


# elementwise.c holds a row in fp32 in a stack buffer of at most this many floats: wider rows
# go to the reference
MAX_NORM_HIDDEN = 65536


def supports_norm(x: torch.Tensor, *others: torch.Tensor) -> bool:
    return supports(x, *others) and x.shape[1] <= MAX_NORM_HIDDEN


def _check(rc: int, op: str) -> None:
    if rc != 0:
        raise ValueError(f"CPU {op}: arguments rejected")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    t, h = x.shape
    w = weight.contiguous()
    out = torch.empty((t, h), dtype=x.dtype)
    _check(load().llmsvc_rms_norm(_DTYPES[x.dtype], x.data_ptr(), x.stride(0), w.data_ptr(),
                                  out.data_ptr(), t, h, float(eps), torch.get_num_threads()), "rms_norm")
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    t, h = x.shape
    w = weight.contiguous()
    out, s = torch.empty((t, h), dtype=x.dtype), torch.empty((t, h), dtype=x.dtype)
    _check(load().llmsvc_fused_add_rms_norm(_DTYPES[x.dtype], x.data_ptr(), x.stride(0),
                                            residual.data_ptr(), residual.stride(0), w.data_ptr(),
                                            out.data_ptr(), s.data_ptr(), t, h, float(eps),
                                            torch.get_num_threads()), "fused_add_rms_norm")
    return out, s


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    t, d2 = x.shape
    if d2 % 2:
        raise ValueError(f"silu_and_mul: the last dimension ({d2}) holds gate and up halves, so must be even")
    out = torch.empty((t, d2 // 2), dtype=x.dtype)
    _check(load().llmsvc_silu_and_mul(_DTYPES[x.dtype], x.data_ptr(), x.stride(0), out.data_ptr(),
                                      t, d2 // 2, torch.get_num_threads()), "silu_and_mul")
    return out


def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                     cos_sin_cache: torch.Tensor, head_size: int) -> None:
    """In place on query [T, Hq * head_size] and key [T, Hkv * head_size] (rows may be strided)."""
    t = query.shape[0]
    pos, cache = as_c_array(positions, torch.int64), as_c_array(cos_sin_cache, torch.float32)
    _check(load().llmsvc_rotary_neox(_DTYPES[query.dtype], pos.data_ptr(), query.data_ptr(),
                                     query.stride(0), query.shape[1] // head_size, key.data_ptr(),
                                     key.stride(0), key.shape[1] // head_size, head_size,
                                     cache.data_ptr(), cache.shape[1], cache.shape[0], t,
                                     torch.get_num_threads()), "rotary_embedding (position out of range?)")


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x: [T, V] fp32 -> [T] int64, first maximum per row (NaN counts as maximum)."""
    t, v = x.shape
    out = torch.empty(t, dtype=torch.int64)
    _check(load().llmsvc_argmax_rows(x.data_ptr(), x.stride(0), out.data_ptr(), t, v,
                                     torch.get_num_threads()), "argmax")
    return out
