"""Every decoder layer of a Llama-family model in one native call (`decoder.c`).

The model hands over its per-layer weights once (`make_plan`); a step whose every GEMM
would take the native packed kernels anyway (fp32 panels up to PANEL_MAX_M rows, bf16 panels
up to `linear.bf16_max_m()`: AMX tiles, AVX512-BF16 dot products or, on AVX-512F or AVX2
without either, panels widened to fp32) then runs all layers in one ctypes call instead of ~20
Python-level calls per layer.
The result is bit for bit the per-op path's (the same kernels with the same arguments), which
is this op's reference: `tests/test_native_layers.py` checks it.
"""
from __future__ import annotations

import ctypes
import logging
import os
import sys
from dataclasses import dataclass
from typing import Optional

import torch

from kernels.cpu_ops import int8, linear
from kernels.cpu_ops.build import DTYPE_CODES, as_c_array, as_c_rows, load

logger = logging.getLogger(__name__)

LP_N = 11  # decoder.c's LP_* fields per layer
_LP_QKV, _LP_O, _LP_GATE_UP, _LP_DOWN, _LP_GGUF, _LP_INT8 = 2, 4, 5, 6, 9, 10  # and the bits of LP_GGUF / LP_INT8
_INT8_ISA_SHIFT = 16  # LP_INT8 holds the int8 GEMM's ISA code from this bit up
# decoder.c's PROF_* slots, in order: what `DecoderPlan.profile` accumulates seconds under
PROFILE_KINDS = ("norm", "qkv", "rope", "store_kv", "attention", "o", "gate_up", "silu", "down")


class _LoraArgs(ctypes.Structure):
    """decoder.c's lora_t."""
    _fields_ = [(name, ctypes.c_int64) for name in ("G", "S")] + [
        (name, ctypes.c_void_p) for name in ("slot", "off", "rows", "ptrs", "width", "xg", "h", "d", "ridx")]


@dataclass
class NativeLoRA:
    """A step's LoRA adapters for `DecoderPlan.run`: groups of rows (ascending token indexes)
    per adapter slot, and per layer the packed A / B of each projection (q/k/v, o, gate/up, down)
    and slot, as addresses (0: that slot's adapter leaves the projection alone)."""
    group_slots: torch.Tensor  # [G] int64
    group_offsets: torch.Tensor  # [G + 1] int64: group g is rows[offsets[g]:offsets[g + 1]]
    rows: torch.Tensor  # [sum of group sizes] int64
    ptrs: torch.Tensor  # [L, 4, S, 2] int64
    widths: torch.Tensor  # [L, 4] int64: R of each projection's A (rows) and B (columns)


@dataclass
class LayerWeights:
    """One layer's tensors as the model holds them: norm weights [H], packed projection
    weights (from `pack_linear_weight`, `pack_gguf_blocks` in an fp32 model, or int8 blobs from
    `pack_int8_weight` under `--quantization int8`), the optional
    qkv bias [(Hq + 2 Hkv) D]."""
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: Optional[torch.Tensor]
    o: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


def enabled() -> bool:
    return os.environ.get("LLMSVC_NATIVE_LAYERS", "1") not in ("", "0")


class DecoderPlan:
    """Addresses of one model's layer weights; `run` executes a step's layers when it can."""

    def __init__(self, layers: list[LayerWeights], dtype: torch.dtype, hidden: int, num_heads: int,
                 num_kv_heads: int, head_dim: int, intermediate: int, eps: float,
                 cos_sin_cache: torch.Tensor, scale: float, sliding_window: int = 0):
        self.layers, self.dtype, self.code = layers, dtype, DTYPE_CODES[dtype]
        self.h, self.hq, self.hkv, self.d, self.i = hidden, num_heads, num_kv_heads, head_dim, intermediate
        self.eps, self.scale, self.cos_sin = float(eps), float(scale), cos_sin_cache
        self.window = int(sliding_window)  # every layer's (0: full attention)
        self.ptrs = torch.zeros((len(layers), LP_N), dtype=torch.int64)
        int8_isa = int8.ISAS.index(int8.isa()) << _INT8_ISA_SHIFT if _has_int8(layers) else 0
        for row, lw in zip(self.ptrs, layers):
            row[:7] = torch.tensor([lw.input_norm.data_ptr(), lw.post_norm.data_ptr(), lw.qkv.data_ptr(),
                                    0 if lw.qkv_bias is None else lw.qkv_bias.data_ptr(), lw.o.data_ptr(),
                                    lw.gate_up.data_ptr(), lw.down.data_ptr()])
            projections = ((_LP_QKV, lw.qkv), (_LP_O, lw.o), (_LP_GATE_UP, lw.gate_up), (_LP_DOWN, lw.down))
            row[_LP_GGUF] = sum(1 << bit for bit, p in projections if _is_gguf(p))
            row[_LP_INT8] = sum(1 << bit for bit, p in projections if int8.is_packed(p)) | int8_isa
        # the float panels' row limit; the int8 GEMM has none, so an all-int8 model takes any step
        all_int8 = all(int8.is_packed(p) for lw in layers for p in (lw.qkv, lw.o, lw.gate_up, lw.down))
        self.max_m = (sys.maxsize if all_int8 else linear.PANEL_MAX_M if dtype == torch.float32
                      else linear.bf16_max_m())
        self._caches_key: tuple = ()
        self._fn = load().llmsvc_llama_layers
        self.profile: Optional[torch.Tensor] = None  # see enable_profile

    def enable_profile(self) -> torch.Tensor:
        """From now on every `run` adds each kind of kernel call's wall seconds (row 0) and
        calling-thread CPU seconds (row 1) to the returned [2, len(PROFILE_KINDS)] float64
        tensor (decoder.c's PROF_* order); zero it to start over."""
        self.profile = torch.zeros((2, len(PROFILE_KINDS)), dtype=torch.float64)
        return self.profile

    def _bind_caches(self, kv_caches: list) -> bool:
        first, last = kv_caches[0][0], kv_caches[-1][1]
        key = (len(kv_caches), first.data_ptr(), last.data_ptr(), first.shape)
        if key == self._caches_key:
            return True
        if len(kv_caches) != len(self.layers) or first.numel() == 0:
            return False
        for l, (kc, vc) in enumerate(kv_caches):
            if not (kc.is_cpu and kc.dtype == self.dtype == vc.dtype and kc.is_contiguous()
                    and vc.is_contiguous() and kc.shape == vc.shape and tuple(kc.shape[2:]) == (self.hkv, self.d)):
                return False
            self.ptrs[l, 7], self.ptrs[l, 8] = kc.data_ptr(), vc.data_ptr()
        self._caches_key = key
        return True

    def run(self, hidden: torch.Tensor, positions: torch.Tensor, meta,
            kv_caches: Optional[list], lora: Optional[NativeLoRA] = None) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """hidden: [T, H] embeddings (overwritten). Returns (hidden, residual) after the last
        layer, as the per-op loop would, or None when this step must take that loop (no cache,
        too many rows for the native GEMMs, unexpected dtypes or layouts). lora: the step's
        adapters, added after each projection as ops.lora_add_ adds them."""
        t = hidden.shape[0]
        if (not kv_caches or t == 0 or t > self.max_m or hidden.dtype != self.dtype
                or not hidden.is_cpu or not hidden.is_contiguous() or not self._bind_caches(kv_caches)):
            return None
        kc = kv_caches[0][0]
        nb, bs = kc.shape[0], kc.shape[1]
        pos, slots = as_c_array(positions, torch.int64), as_c_array(meta.slot_mapping, torch.int64)
        bt = as_c_rows(meta.block_tables, torch.int32)
        qsl, sl = as_c_array(meta.query_start_loc, torch.int32), as_c_array(meta.seq_lens, torch.int32)
        q, kv = self.hq * self.d, self.hkv * self.d
        dt = self.dtype
        res, nrm = torch.empty((t, self.h), dtype=dt), torch.empty((t, self.h), dtype=dt)
        qkv, att = torch.empty((t, q + 2 * kv), dtype=dt), torch.empty((t, q), dtype=dt)
        gu, act = torch.empty((t, 2 * self.i), dtype=dt), torch.empty((t, self.i), dtype=dt)
        lora_args = None if lora is None else self._lora_args(lora, t, q + 2 * kv)
        rc = self._fn(self.code, len(self.layers), self.ptrs.data_ptr(), hidden.data_ptr(), res.data_ptr(),
                      nrm.data_ptr(), qkv.data_ptr(), att.data_ptr(), gu.data_ptr(), act.data_ptr(),
                      pos.data_ptr(), self.cos_sin.data_ptr(), self.cos_sin.shape[1], self.cos_sin.shape[0],
                      slots.data_ptr(), nb * bs, bt.data_ptr(), bt.stride(0), qsl.data_ptr(), sl.data_ptr(),
                      sl.shape[0], t, self.h, self.hq, self.hkv, self.d, self.i, bs, self.eps, self.scale,
                      self.window, torch.get_num_threads(),
                      None if self.profile is None else self.profile.data_ptr(),
                      None if lora_args is None else ctypes.addressof(lora_args[0]))
        if rc != 0:
            raise ValueError("CPU decoder layers: a kernel rejected its arguments "
                             "(position or slot out of range, or query longer than its context)")
        return hidden, res


    def _lora_args(self, lora: NativeLoRA, t: int, n_qkv: int) -> tuple:
        """(lora_t, the tensors it points into: kept alive through the call)."""
        r_max = int(lora.widths.max())
        keep = (lora.group_slots, lora.group_offsets, lora.rows, lora.ptrs, lora.widths,
                torch.empty((t, max(self.h, self.hq * self.d, self.i)), dtype=self.dtype),
                torch.empty((t, r_max), dtype=self.dtype), torch.empty((t, max(n_qkv, self.h, 2 * self.i)), dtype=self.dtype),
                torch.empty(t, dtype=torch.int64))
        args = _LoraArgs(lora.group_slots.shape[0], lora.ptrs.shape[2], *(x.data_ptr() for x in keep))
        return args, keep


def _is_gguf(packed: torch.Tensor) -> bool:
    """Whether a packed weight is GGUF blocks (linear.pack_gguf_blocks' blob)."""
    return packed.dtype == torch.uint8 and packed.dim() == 1


def _has_int8(layers: list[LayerWeights]) -> bool:
    return any(int8.is_packed(p) for lw in layers for p in (lw.qkv, lw.o, lw.gate_up, lw.down))


def make_plan(layers: list[LayerWeights], dtype: torch.dtype, hidden: int, num_heads: int,
              num_kv_heads: int, head_dim: int, intermediate: int, eps: float,
              cos_sin_cache: torch.Tensor, scale: float, sliding_window: int = 0) -> Optional[DecoderPlan]:
    """A plan when every layer's tensors suit the native kernels (CPU, fp32 with gemm.c
    panels or bf16 with gemm_bf16.c's panels, GGUF blocks in fp32, int8 blobs where a native
    int8 GEMM runs; contiguous, head_dim a multiple of 16), else None."""
    if not enabled() or dtype not in DTYPE_CODES or not layers:
        return None
    if head_dim % 16 or head_dim > 512 or hidden > 65536 or num_heads % num_kv_heads:
        return None
    if not (cos_sin_cache.is_cpu and cos_sin_cache.dtype == torch.float32 and cos_sin_cache.is_contiguous()):
        return None
    for lw in layers:
        for p in (lw.qkv, lw.o, lw.gate_up, lw.down):  # 3-D: our own panels, not MKL / oneDNN's
            if p is None or not p.is_cpu or not ((p.dim() == 3 and p.dtype == dtype)
                                                 or (_is_gguf(p) and dtype == torch.float32)
                                                 or int8.is_packed(p)):
                return None
        for w in (lw.input_norm, lw.post_norm, lw.qkv_bias):
            if w is not None and (w.dtype != dtype or not w.is_cpu or not w.is_contiguous()):
                return None
    if load() is None:  # last: a GPU model never builds the CPU library for this
        return None
    if _has_int8(layers) and int8.isa() == "ref":  # no native int8 GEMM: the torch reference per op
        return None
    plan = DecoderPlan(layers, dtype, hidden, num_heads, num_kv_heads, head_dim, intermediate, eps,
                       cos_sin_cache, scale, sliding_window)
    limit = "any size" if plan.max_m == sys.maxsize else f"up to {plan.max_m} tokens"
    logger.info("CPU decoder layers: %d layers in one native call for steps of %s (%s, %s GEMM)%s",
                len(layers), limit, str(dtype).removeprefix("torch."),
                f"int8 {int8.isa()}" if _has_int8(layers)
                else "GGUF-block panel" if int(plan.ptrs[:, _LP_GGUF].sum())
                else "panel" if dtype == torch.float32
                else "AMX" if linear.has_amx() else "AVX512-BF16" if linear.bf16_layout() == "vnni"
                else "widened panel", "" if plan.max_m == sys.maxsize else "; larger steps run layer by layer")
    return plan
