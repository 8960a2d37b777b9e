"""int8 GEMM (`--quantization int8`) against the bf16 and fp32 packed GEMMs at the model's shapes.

    python -m benchmarks.gemm_int8 [--rows 1,16,64,256,1024] [--layers 30] [--rounds 3]
                                   [--paths avx2,avx2_w7]

Random weights with the default model's decoder layer shapes (SmolLM2-135M: q/k/v 960 x 576,
o 576 x 576, gate/up 3072 x 576, down 576 x 1536, 30 layers; the LM head is not quantized) are
packed as the engine packs them; each round multiplies an [M, K] activation through every
layer, so at decode sizes the weights stream from DRAM as in a step. Prints ms per pass (best
of the rounds) for
  int8   `kernels.cpu_ops.int8.linear` on the path this CPU runs (int8.isa(); LLMSVC_INT8_ISA
         forces one), bf16 activations in and out, quantized per token inside the call; with
         --paths, one column per int8 path named (int8.available_isas()), each on weights
         packed for it (int8.weight_qmax)
  bf16   `kernels.ops.linear` on the bf16 packed weight (whatever pack_linear_weight chose)
  fp32   the same on the fp32 packed weight
Implementations alternate round by round, so a slow phase of the machine hits all of them;
the best and the median round are printed.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from kernels import ops
from kernels.cpu_ops import int8

SHAPES = [("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536)]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,16,64,256,1024", help="comma-separated M values")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--paths", default="", help="int8 paths to compare (default: int8.isa())")
    a = ap.parse_args(argv)
    paths = a.paths.split(",") if a.paths else [int8.isa()]
    if set(paths) - set(int8.available_isas()):
        ap.error(f"--paths: this CPU / build runs {', '.join(int8.available_isas())}")
    g = torch.Generator().manual_seed(0)
    w32 = [torch.randn(n, k, generator=g) * 0.02 for _ in range(a.layers) for _, n, k in SHAPES]
    w16 = [w.bfloat16() for w in w32]
    p32, p16 = [ops.pack_linear_weight(w) for w in w32], [ops.pack_linear_weight(w) for w in w16]
    p8 = {path: [int8.pack(w, qmax=int8.weight_qmax(path)) for w in w16] for path in paths}
    int8s = {(path if len(paths) > 1 else "int8"): path for path in paths}
    impls = {name: (lambda x, i, path=path: int8.linear(x, p8[path][i], path=path)) for name, path in int8s.items()}
    impls["bf16"] = lambda x, i: ops.linear(x, w16[i], None, p16[i])
    impls["fp32"] = lambda x, i: ops.linear(x, w32[i], None, p32[i])
    mb = {"int8": sum(p.numel() for p in p8[paths[0]]), "bf16": 2 * sum(w.numel() for w in w32),
          "fp32": 4 * sum(w.numel() for w in w32)}
    print(f"{a.layers} layers, weights int8 {mb['int8'] / 1e6:.0f} MB / bf16 {mb['bf16'] / 1e6:.0f} MB / fp32 "
          f"{mb['fp32'] / 1e6:.0f} MB, {torch.get_num_threads()} threads, int8 path {', '.join(paths)}")
    for m in (int(r) for r in a.rows.split(",")):
        xs = {k: torch.randn(m, k, generator=g) for k in {w.shape[1] for w in w32}}
        xs16 = {k: x.bfloat16() for k, x in xs.items()}
        times: dict[str, list[float]] = {name: [] for name in impls}
        for r in range(a.rounds + 1):
            for name, f in impls.items():
                inputs = xs if name == "fp32" else xs16
                t0 = time.perf_counter()
                for i, w in enumerate(w32):
                    f(inputs[w.shape[1]], i)
                if r:  # round 0 warms up
                    times[name].append(time.perf_counter() - t0)
        best = {name: min(t) for name, t in times.items()}
        flops = 2 * m * sum(w.numel() for w in w32)
        print(f"  M = {m:4d}: " + ", ".join(f"{name} {s * 1e3:7.1f} ms (median {statistics.median(times[name]) * 1e3:7.1f}; "
                                          f"{flops / s / 1e9:5.1f} GOP/s)" for name, s in best.items()), flush=True)
        print("          " + ", ".join(f"{name} / bf16 {best['bf16'] / best[name]:.2f}x, / fp32 "
                                      f"{best['fp32'] / best[name]:.2f}x" for name in int8s), flush=True)


if __name__ == "__main__":
    main()
