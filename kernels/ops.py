"""The one dispatch point between the torch reference and the Triton kernels.

Model code calls only these functions. Today every op runs the torch reference
(`kernels/reference.py`); the Triton implementations plug in here for CUDA tensors.
"""
from __future__ import annotations

from kernels import reference as _ref

rms_norm = _ref.rms_norm
fused_add_rms_norm = _ref.fused_add_rms_norm
silu_and_mul = _ref.silu_and_mul
rotary_embedding = _ref.rotary_embedding
store_kv = _ref.store_kv
paged_attention = _ref.paged_attention
