"""Decode-step weight stream: every linear layer of a model's shape, packed GEMM against peers.

    python -m benchmarks.gemm [--dtype bfloat16] [--rows 16,32,64] [--layers 30]

Random weights with the default model's layer shapes (SmolLM2-135M: hidden 576, 9 heads of
64, 3 KV heads, intermediate 1536, vocab 49152, 30 layers) are packed as the engine packs
them; each round multiplies an [M, K] activation through all layers and the LM head, so
the weights stream from DRAM as in a decode step. Prints ms per pass (best of the rounds)
and the weight bytes per second for:
  ours     `kernels.ops.linear` on the engine's packed copy (gemm.c fp32 panels, gemm_bf16.c
           bf16 VNNI panels on AMX or AVX512-BF16, bf16 panels widened to fp32 elsewhere;
           whatever `pack_linear_weight` chose on this CPU)
  library  MKL's packed sgemm (fp32) or oneDNN's packed matmul (bf16), the paths torch's
           inductor uses for frozen weights; left out where oneDNN has no bf16 (AVX2 only)
  F.linear torch's plain linear on the unpacked weight
Implementations alternate round by round, so a slow phase of the machine hits all of them.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from kernels import ops
from kernels.cpu_ops import linear

SHAPES = [("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536)]
LM_HEAD = (49152, 576)


def _library_pack(w: torch.Tensor):
    if w.dtype == torch.float32:
        return torch.ops.mkl._mkl_reorder_linear_weight(w, 64)
    return torch.ops.mkldnn._reorder_linear_weight(w, 64)


def _library_linear(x: torch.Tensor, w: torch.Tensor, packed) -> torch.Tensor:
    if w.dtype == torch.float32:  # the overloads kernels/cpu_ops/linear.py resolved
        return linear._mkl_linear(x, packed, w, None, x.shape[0])
    return linear._linear_pointwise(x, packed, None, "none", [], "")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--rows", default="1,16,32,64,128", help="comma-separated M values")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args(argv)
    dt = getattr(torch, a.dtype)
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=g).to(dt) * 0.02 for _ in range(a.layers) for _, n, k in SHAPES]
    weights.append(torch.randn(*LM_HEAD, generator=g).to(dt) * 0.02)
    ours = [ops.pack_linear_weight(w) for w in weights]
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    impls = {"ours": lambda x, i: ops.linear(x, weights[i], None, ours[i])}
    if dt == torch.float32 or linear._linear_pointwise is not None:
        lib = [_library_pack(w) for w in weights]
        impls["library"] = lambda x, i: _library_linear(x, weights[i], lib[i])
    impls["F.linear"] = lambda x, i: F.linear(x, weights[i])
    kind = "none" if ours[0] is None else f"{tuple(ours[0].shape)} {ours[0].dtype}"
    print(f"{a.dtype}, {a.layers} layers + LM head, {nbytes / 1e6:.0f} MB of weights, "
          f"{torch.get_num_threads()} threads; ours packed as {kind}")
    for m in (int(r) for r in a.rows.split(",")):
        xs = {k: torch.randn(m, k, generator=g).to(dt) for k in {w.shape[1] for w in weights}}
        best = {name: float("inf") for name in impls}
        for r in range(a.rounds + 1):
            for name, f in impls.items():
                t0 = time.perf_counter()
                for i, w in enumerate(weights):
                    f(xs[w.shape[1]], i)
                if r:  # round 0 warms up
                    best[name] = min(best[name], time.perf_counter() - t0)
        print(f"  M = {m:4d}: " + ", ".join(f"{name} {s * 1e3:6.1f} ms ({nbytes / s / 1e9:4.1f} GB/s)"
                                          for name, s in best.items()), flush=True)


if __name__ == "__main__":
    main()
