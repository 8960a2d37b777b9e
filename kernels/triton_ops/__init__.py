"""Triton implementations of the ops in `kernels/reference.py`, one file per op.

Importing this package never fails and does not import triton: `HAS_TRITON` says whether
the `triton` package is installed. The op modules themselves import triton and are only imported by
`kernels/ops.py` when `HAS_TRITON` is true. Every wrapper asserts shapes, strides and
dtypes before launching; every kernel loads in the storage dtype and computes in fp32.
"""
from __future__ import annotations

import importlib.util
import os

# found, not imported: importing triton costs ~0.3 s that a CPU-only process never needs
HAS_TRITON = importlib.util.find_spec("triton") is not None

# Triton reads TRITON_INTERPRET when @triton.jit runs (import time): remember what it was.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

# keys per split-K decode program: a decode whose context exceeds this takes the split-K path
# (model runners warm both paths up; defined here so that importing it needs no triton)
DEFAULT_DECODE_SPLIT = 512
