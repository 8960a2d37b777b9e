"""Triton implementations of the ops in `kernels/reference.py`, one file per op.

Importing this package never fails: `HAS_TRITON` says whether the `triton` package is
importable. The op modules themselves import triton and are only imported by
`kernels/ops.py` when `HAS_TRITON` is true. Every wrapper asserts shapes, strides and
dtypes before launching; every kernel loads in the storage dtype and computes in fp32.
"""
from __future__ import annotations

import os

try:  # pragma: no cover - depends on the environment
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:  # pragma: no cover
    HAS_TRITON = False

# Triton reads TRITON_INTERPRET when @triton.jit runs (import time): remember what it was.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

# keys per split-K decode program: a decode whose context exceeds this takes the split-K path
# (model runners warm both paths up; defined here so that importing it needs no triton)
DEFAULT_DECODE_SPLIT = 512
