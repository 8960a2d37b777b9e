"""Small helpers shared by the Triton wrappers (no triton import here)."""
from __future__ import annotations

import torch

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def check_float(name: str, t: torch.Tensor) -> None:
    assert t.dtype in SUPPORTED_DTYPES, f"{name}: unsupported dtype {t.dtype}"


def check_last_contiguous(name: str, t: torch.Tensor) -> None:
    assert t.stride(-1) == 1, f"{name}: last dim must be contiguous, strides={t.stride()}"


def check_same_device(*ts: torch.Tensor) -> None:
    dev = ts[0].device
    assert all(t.device == dev for t in ts), f"tensors on different devices: {[t.device for t in ts]}"
