"""The one dispatch point between the torch reference and the Triton kernels.

Model code calls only these functions. Each op runs its Triton kernel (through the
`llmsvc::*` custom op, see `kernels/custom_ops.py`) when the tensors are on CUDA, or when
the Triton path is forced (env LLMSVC_FORCE_TRITON=1 or `with force_triton():`, meant for
tests under TRITON_INTERPRET=1). On the CPU, the native kernels in `kernels/cpu_ops`
(C + OpenMP: paged attention reading K/V in place, one-pass norms, RoPE and SiLU-and-mul)
run when they are built and take the inputs, and linear layers multiply weights packed
once at load (`pack_linear_weight`): fp32 panels for the native GEMM (MKL without it),
bf16 VNNI panels for AMX tiles or AVX512-BF16 dot products (oneDNN without either). A
model may also hand all its decoder layers to one native call (`decoder_layers`,
`kernels/cpu_ops/decoder.c`), whose reference is the per-op path itself. Anything else calls the torch reference in `kernels/reference.py`
directly, with no custom-op layer in between (it costs ~10x a small CPU op).
Importing this module works without a GPU and without triton (then only the reference runs).
"""
from __future__ import annotations

import contextlib
import os
from typing import Iterator, Optional

import torch
import torch.nn.functional as F

from kernels import reference as _ref
from kernels import reference_moe as _ref_moe
from kernels.cpu_ops import attention as _cpu_attn
from kernels.cpu_ops import decoder as _cpu_decoder
from kernels.cpu_ops import elementwise as _cpu_ew
from kernels.cpu_ops import int8 as _cpu_int8
from kernels.cpu_ops import linear as _cpu_linear
from kernels.triton_ops import HAS_TRITON, INTERPRET

# The Triton kernels (and triton itself, ~0.3 s to import) load on the first CUDA or forced op:
# a CPU process never needs them. Under the interpreter (tests) they load at once.
_tri = _tri_bitmask = None
_forced = HAS_TRITON and os.environ.get("LLMSVC_FORCE_TRITON", "0") not in ("", "0")


def _load_triton() -> bool:
    """True once the Triton ops are imported; False without triton (the reference runs)."""
    global _tri, _tri_bitmask
    if _tri is None and HAS_TRITON:
        from kernels import custom_ops
        from kernels.triton_ops import token_bitmask

        _tri, _tri_bitmask = custom_ops, token_bitmask
    return _tri is not None


if INTERPRET or _forced:
    _load_triton()


@contextlib.contextmanager
def force_triton(enabled: bool = True) -> Iterator[None]:
    """Run the Triton kernels for CPU tensors too (needs TRITON_INTERPRET=1 set before import)."""
    global _forced
    if enabled and not HAS_TRITON:
        raise RuntimeError("force_triton: triton is not installed")
    if enabled and not INTERPRET:
        raise RuntimeError("force_triton: set TRITON_INTERPRET=1 before importing kernels")
    if enabled:
        _load_triton()
    prev, _forced = _forced, enabled
    try:
        yield
    finally:
        _forced = prev


def triton_forced() -> bool:
    return _forced


def _use_triton(t: torch.Tensor) -> bool:
    return _forced or (t.is_cuda and (_tri is not None or _load_triton()))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if _use_triton(x):
        return _tri.rms_norm(x, weight, eps)
    if _cpu_ew.supports_norm(x, weight):
        return _cpu_ew.rms_norm(x, weight, eps)
    return _ref.rms_norm(x, weight, eps)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    if _use_triton(x):
        return _tri.fused_add_rms_norm(x, residual, weight, eps)
    if _cpu_ew.supports_norm(x, residual, weight):
        return _cpu_ew.fused_add_rms_norm(x, residual, weight, eps)
    return _ref.fused_add_rms_norm(x, residual, weight, eps)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if _use_triton(x):
        return _tri.silu_and_mul(x)
    if _cpu_ew.supports(x):
        return _cpu_ew.silu_and_mul(x)
    return _ref.silu_and_mul(x)


def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                     cos_sin_cache: torch.Tensor, head_size: int) -> None:
    if _use_triton(query):
        return _tri.rotary_embedding(positions, query, key, cos_sin_cache, head_size)
    if _cpu_ew.supports(query, key):
        return _cpu_ew.rotary_embedding(positions, query, key, cos_sin_cache, head_size)
    return _ref.rotary_embedding(positions, query, key, cos_sin_cache, head_size)


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    if _use_triton(key):
        return _tri.store_kv(key, value, k_cache, v_cache, slot_mapping)
    if _cpu_attn.supports(key, k_cache):
        return _cpu_attn.store_kv(key, value, k_cache, v_cache, slot_mapping)
    return _ref.store_kv(key, value, k_cache, v_cache, slot_mapping)


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                    seq_lens: torch.Tensor, scale: float, *, max_query_len: Optional[int] = None,
                    max_seq_len: Optional[int] = None, sliding_window: int = 0,
                    soft_cap: float = 0.0) -> torch.Tensor:
    """max_query_len / max_seq_len: optional host-side hints (saves a device sync on CUDA).
    sliding_window > 0: each query sees only its last sliding_window positions (itself
    included); soft_cap > 0: scores become soft_cap * tanh(score / soft_cap)."""
    if _use_triton(query):
        return _tri.paged_attention(query, k_cache, v_cache, block_tables, query_start_loc,
                                    seq_lens, scale, max_query_len, max_seq_len,
                                    sliding_window=sliding_window, soft_cap=soft_cap)
    if _cpu_attn.supports(query, k_cache):
        return _cpu_attn.paged_attention(query, k_cache, v_cache, block_tables, query_start_loc,
                                         seq_lens, scale, sliding_window, soft_cap)
    return _ref.paged_attention(query, k_cache, v_cache, block_tables, query_start_loc,
                                seq_lens, scale, sliding_window, soft_cap)


def moe_route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k routing: (topk_weights [T, k] float32, topk_ids [T, k] int64). Plain torch
    on every device (a few small ops next to the expert GEMMs)."""
    return _ref_moe.moe_route(router_logits, top_k, renormalize)


def pack_moe_weights(w13: torch.Tensor, w2: torch.Tensor) -> Optional[tuple[list, list]]:
    """Called once after loading: each expert's w13[e] [2I, H] and w2[e] [H, I] packed as
    `pack_linear_weight` packs a linear weight, or None where any of them would not be."""
    packed = ([_cpu_linear.pack(w) for w in w13], [_cpu_linear.pack(w) for w in w2])
    return None if any(p is None for p in packed[0] + packed[1]) else packed


def fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, packed: Optional[tuple[list, list]] = None) -> torch.Tensor:
    """Experts' gated MLPs over hidden [T, H], weighted by the routing: [T, H] (kernels/reference_moe.py).
    `packed` (from pack_moe_weights) runs each expert's GEMMs on the CPU packed kernels."""
    if _use_triton(hidden):
        return _tri.fused_moe(hidden, w13, w2, topk_weights, topk_ids)
    if packed is None or not hidden.is_cpu:
        return _ref_moe.fused_moe(hidden, w13, w2, topk_weights, topk_ids)
    p13, p2 = packed

    def expert_mlp(e: int, x: torch.Tensor) -> torch.Tensor:
        return _cpu_linear.linear(silu_and_mul(_cpu_linear.linear(x, w13[e], None, p13[e])), w2[e], None, p2[e])
    return _ref_moe.grouped_by_expert(hidden, topk_weights, topk_ids, w13.shape[0], expert_mlp)


def pack_linear_weight(weight: torch.Tensor) -> Optional[torch.Tensor]:
    """Called once after loading: a pre-packed copy of a linear weight [N, K] for `linear`,
    or None where the plain path is used (CUDA, fp16, no MKL / oneDNN, LLMSVC_CPU_KERNELS=0)."""
    return _cpu_linear.pack(weight)


def pack_gguf_blocks(qweight: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> Optional[torch.Tensor]:
    """Called once after loading, for an fp32 weight that is the dequantization of GGUF blocks
    (`reference.dequantize_gguf_blocks`): the blocks packed for `linear` on the CPU, or None
    where the native GEMM is not built (the caller packs the fp32 weight instead)."""
    return _cpu_linear.pack_gguf_blocks(qweight, scale, offset)


def pack_int8_weight(weight: torch.Tensor, smooth: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Called once after loading under `--quantization int8`: weight [N, K] (times SmoothQuant's
    per-input-channel factors `smooth` [K], if given) quantized per output channel and packed
    for `linear` (kernels/cpu_ops/int8.py), native GEMM or not."""
    return _cpu_int8.pack(weight, smooth)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
           packed: Optional[torch.Tensor] = None) -> torch.Tensor:
    """F.linear(x, weight, bias); `packed` (from pack_linear_weight) selects the CPU packed GEMM,
    an int8 blob (pack_int8_weight) the int8 GEMM, whose `weight` may be on the meta device."""
    if packed is not None and packed.dtype == torch.int8:
        return _cpu_int8.linear(x, packed, bias)
    if packed is not None and x.is_cpu:
        return _cpu_linear.linear(x, weight, bias, packed)
    return F.linear(x, weight, bias)


def lora_add_(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
              groups: list, packed: Optional[list] = None, token_slots: Optional[torch.Tensor] = None) -> None:
    """LoRA's low-rank update, in place: y[rows] += (x[rows] @ lora_a[slot].T) @ lora_b[slot].T
    for each (slot, rows) of groups (reference.lora_add_ has the shapes). Two small GEMMs per
    adapter in the step. packed: per slot, pack_linear_weight of lora_a[slot] and lora_b[slot]
    (the CPU's packed GEMM; torch's own bf16 GEMM of these thin shapes is ~3x slower on a CPU
    without bf16 arithmetic). token_slots: the same mapping per token ([T], -1: base model), for
    the Triton kernels on CUDA (one launch per projection whatever the mix of adapters)."""
    if token_slots is not None and _use_triton(x):
        return _tri.lora_add_(y, x, lora_a, lora_b, token_slots)
    if packed is None or not x.is_cpu or any(packed[s][0] is None or packed[s][1] is None for s, _ in groups):
        return _ref.lora_add_(y, x, lora_a, lora_b, groups)
    for slot, rows in groups:
        pa, pb = packed[slot]
        xs = x if rows is None else x.index_select(0, rows)
        delta = _cpu_linear.linear(_cpu_linear.linear(xs, lora_a[slot], None, pa), lora_b[slot], None, pb)
        if rows is None:
            y += delta
        else:
            y.index_add_(0, rows, delta)


DecoderLayerWeights = _cpu_decoder.LayerWeights


def decoder_layers_plan(layers: list, dtype: torch.dtype, hidden: int, num_heads: int,
                        num_kv_heads: int, head_dim: int, intermediate: int, eps: float,
                        cos_sin_cache: torch.Tensor, scale: float, sliding_window: int = 0):
    """A handle for running every Llama decoder layer in one native call (`decoder_layers`),
    or None where the per-op path is the only one (GPU, forced Triton, weights not packed for
    the native GEMMs, LLMSVC_NATIVE_LAYERS=0). layers: DecoderLayerWeights per layer."""
    if _forced:
        return None
    return _cpu_decoder.make_plan(layers, dtype, hidden, num_heads, num_kv_heads, head_dim,
                                  intermediate, eps, cos_sin_cache, scale, sliding_window)


NativeLoRA = _cpu_decoder.NativeLoRA


def decoder_layers(plan, hidden: torch.Tensor, positions: torch.Tensor, meta, kv_caches, lora=None):
    """(hidden, residual) after every layer, bit for bit what the per-op layers give, or None
    when this step must run layer by layer. hidden [T, H] (the embeddings) is overwritten.
    lora: a NativeLoRA, the step's LoRA adapters (each projection adds them as lora_add_ does)."""
    if plan is None or _forced:
        return None
    return plan.run(hidden, positions, meta, kv_caches, lora)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """[T, V] logits -> [T] int64 index of each row's first maximum (greedy sampling)."""
    if x.dtype == torch.float32 and x.dim() == 2 and x.shape[1] > 0 and _cpu_ew.supports(x):
        return _cpu_ew.argmax_rows(x)
    return _ref.argmax_rows(x)


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """Structured output: in place, logits[rows[r], t] = -inf where bit t of bitmask[r] is 0.

    logits [S, V] float, bitmask [R, W] int32, rows [R] int64 (see the reference for the
    widths). Called outside CUDA graphs and torch.compile, so no custom-op layer."""
    if _use_triton(logits):
        _tri_bitmask.apply_token_bitmask_(logits, bitmask, rows)
    else:
        _ref.apply_token_bitmask_(logits, bitmask, rows)
