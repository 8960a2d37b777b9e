"""Compile every kernel for a real GPU target on any machine (no GPU needed).

`compile_all(arch)` runs Triton's full pipeline to a cubin for GPUTarget("cuda", arch, 32)
for one representative specialisation of each kernel and returns its resource use. This
catches what the interpreter lets through (unsupported constructs, tl.dot shape limits).
"""
from __future__ import annotations

from dataclasses import dataclass

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels.triton_ops.fused_moe import BLOCK_K as MOE_BLOCK_K
from kernels.triton_ops.fused_moe import BLOCK_N as MOE_BLOCK_N
from kernels.triton_ops.fused_moe import _moe_gemm_kernel
from kernels.triton_ops.lora import _lora_expand_kernel, _lora_shrink_kernel
from kernels.triton_ops.paged_decode import _decode_reduce_kernel, _decode_split_kernel
from kernels.triton_ops.rms_norm import _rms_norm_kernel
from kernels.triton_ops.rotary_embedding import _rope_kernel
from kernels.triton_ops.silu_and_mul import _silu_and_mul_kernel
from kernels.triton_ops.store_kv import _store_kv_kernel
from kernels.triton_ops.varlen_attention import _varlen_attn_kernel


@dataclass
class CompiledKernel:
    name: str
    shared_bytes: int
    num_warps: int
    cubin_bytes: int


def _sig(fn, types: dict[str, str], constexprs: dict[str, object]) -> dict[str, str]:
    names = fn.arg_names
    missing = set(names) - set(types) - set(constexprs)
    assert not missing, f"{fn.__name__}: no type for {sorted(missing)}"
    return {n: ("constexpr" if n in constexprs else types[n]) for n in names}


def kernel_specs(dtype: str = "fp16", head_dim: int = 64, group: int = 4):
    """[(name, jit fn, arg types, constexprs, num_warps)] for one model shape."""
    p, i, f = f"*{dtype}", "i32", "fp32"
    d_pad = max(16, triton.next_power_of_2(head_dim))
    qh = triton.next_power_of_2(group)
    prec = "ieee" if dtype == "fp32" else "tf32"
    return [
        ("rms_norm", _rms_norm_kernel,
         dict(x_ptr=p, res_ptr=p, w_ptr=p, out_ptr=p, res_out_ptr=p, stride_x=i, stride_r=i,
              stride_o=i, stride_ro=i, hidden=i, eps=f), dict(HAS_RESIDUAL=False, BLOCK=1024), 4),
        ("fused_add_rms_norm", _rms_norm_kernel,
         dict(x_ptr=p, res_ptr=p, w_ptr=p, out_ptr=p, res_out_ptr=p, stride_x=i, stride_r=i,
              stride_o=i, stride_ro=i, hidden=i, eps=f), dict(HAS_RESIDUAL=True, BLOCK=1024), 4),
        ("silu_and_mul", _silu_and_mul_kernel,
         dict(x_ptr=p, out_ptr=p, stride_x=i, stride_o=i, d=i), dict(BLOCK=1024), 4),
        ("rotary_embedding", _rope_kernel,
         dict(pos_ptr="*i64", q_ptr=p, k_ptr=p, cache_ptr="*fp32", stride_q=i, stride_k=i,
              stride_c=i, num_q_heads=i, num_kv_heads=i, head_size=i, half=i),
         dict(HQ_PAD=16, HKV_PAD=4, HALF_PAD=d_pad // 2), 4),
        ("store_kv", _store_kv_kernel,
         dict(k_ptr=p, v_ptr=p, kc_ptr=p, vc_ptr=p, slot_ptr="*i64", stride_kt=i, stride_kh=i,
              stride_vt=i, stride_vh=i, stride_cs=i, stride_ch=i, num_kv_heads=i, head_size=i),
         dict(H_PAD=4, D_PAD=d_pad), 4),
        ("varlen_attention", _varlen_attn_kernel,
         dict(q_ptr=p, kc_ptr=p, vc_ptr=p, out_ptr=p, bt_ptr="*i32", qsl_ptr="*i32",
              seq_lens_ptr="*i32", scale=f, window=i, soft_cap=f, stride_qt=i, stride_qh=i,
              stride_ot=i, stride_oh=i,
              stride_cb=i, stride_cs=i, stride_ch=i, stride_bt=i, block_size=i, head_size=i,
              group=i),
         dict(QH_PAD=qh, BLOCK_Q=max(1, 64 // qh), BLOCK_N=32, D_PAD=d_pad, SKIP_DECODE=True,
              DOT_PREC=prec, HAS_SOFT_CAP=False), 4),
        ("paged_decode_split", _decode_split_kernel,
         dict(q_ptr=p, kc_ptr=p, vc_ptr=p, bt_ptr="*i32", qsl_ptr="*i32", seq_lens_ptr="*i32",
              part_o_ptr="*fp32", part_m_ptr="*fp32", part_l_ptr="*fp32", scale=f, window=i,
              soft_cap=f, stride_qt=i,
              stride_qh=i, stride_cb=i, stride_cs=i, stride_ch=i, stride_bt=i, block_size=i,
              head_size=i, group=i, num_q_heads=i, num_splits=i),
         dict(QH_PAD=max(16, qh), SPLIT_SIZE=512, BLOCK_N=32, D_PAD=d_pad, DOT_PREC=prec,
              HAS_SOFT_CAP=False), 4),
        ("paged_decode_reduce", _decode_reduce_kernel,
         dict(part_o_ptr="*fp32", part_m_ptr="*fp32", part_l_ptr="*fp32", out_ptr=p,
              qsl_ptr="*i32", stride_ot=i, stride_oh=i, head_size=i, num_q_heads=i,
              num_splits=i), dict(S_PAD=16, D_PAD=d_pad), 4),
        ("lora_shrink", _lora_shrink_kernel,
         dict(x_ptr=p, a_ptr=p, slot_ptr="*i32", h_ptr="*fp32", stride_x=i, stride_as=i, stride_ar=i,
              stride_h=i, K=i, R=i), dict(BLOCK_R=64, BLOCK_K=128), 4),
        ("lora_expand", _lora_expand_kernel,
         dict(h_ptr="*fp32", b_ptr=p, slot_ptr="*i32", y_ptr=p, stride_h=i, stride_bs=i, stride_bn=i,
              stride_y=i, R=i, N=i), dict(BLOCK_N=128, BLOCK_R=64), 4),
    ] + [
        (name, _moe_gemm_kernel,
         dict(a_ptr=p, b_ptr=p, c_ptr=c, w_ptr="*fp32", pair_ptr="*i32", tile_expert_ptr="*i32",
              num_pairs=i, n_out=i, k_in=i, a_row_div=i, stride_am=i, stride_be=i, stride_bn=i, stride_cm=i),
         dict(MUL_WEIGHT=mul, BLOCK_M=64, BLOCK_N=MOE_BLOCK_N, BLOCK_K=MOE_BLOCK_K, DOT_PREC=prec), 4)
        for name, c, mul in (("fused_moe_gate_up", p, False), ("fused_moe_down", "*fp32", True))
    ]


def compile_all(arch: int, dtype: str = "fp16", **shape) -> list[CompiledKernel]:
    """Compile every kernel for sm_<arch>; raises if any fails to compile."""
    target = GPUTarget("cuda", arch, 32)
    out = []
    for name, fn, types, consts, warps in kernel_specs(dtype, **shape):
        src = ASTSource(fn, _sig(fn, types, consts), consts)
        k = triton.compile(src, target=target, options={"num_warps": warps})
        out.append(CompiledKernel(name, int(k.metadata.shared), int(k.metadata.num_warps),
                                  len(k.asm["cubin"])))
    return out


def main(argv: list[str] | None = None) -> None:
    """python -m kernels.triton_ops.aot ARCH:DTYPE ... -> one JSON list of compiled kernels.

    Must run with TRITON_INTERPRET unset/0: interpreted functions cannot be compiled.
    """
    import json
    import sys
    from dataclasses import asdict

    results = []
    for spec in (argv if argv is not None else sys.argv[1:]) or ["80:fp16", "90:fp16"]:
        arch, dtype = spec.split(":")
        for k in compile_all(int(arch), dtype, head_dim=128, group=4):
            results.append({"arch": int(arch), "dtype": dtype, **asdict(k)})
    print(json.dumps(results))


if __name__ == "__main__":
    main()
