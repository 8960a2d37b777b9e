"""Two builds of a packed CPU GEMM, side by side in one process, called alternately.

    python -m benchmarks.gemm_ab [--base REV] [--dtype bfloat16|bfloat16-widen|float32|gguf|int8]
                                 [--rows 1,16,64] [--threads 2] [--rounds 25] [--reuse]

Compiles the GEMM's source (`gemm_bf16dp.c`, AVX512-BF16 dot products; `gemm.c`, fp32 panels,
its bf16 entry that widens bf16 panels on AVX2, `bfloat16-widen`, or its GGUF-block entry with
the weights rounded to Q4_1-like blocks, `gguf`: `--base` must know the blob of 5a3f487; or
the int8 GEMM's sources, `int8`: bf16 activations, the weights packed by kernels/cpu_ops/int8.py,
the path int8.isa() picks, by its code in int8.ISAS: a --base before the avx2_w7 path numbers
the paths otherwise) as committed at --base
(default HEAD) and as it is in the working tree, each into its own library with the engine's
flags, and multiplies an [M, K] activation through the default
model's 30 layers of packed weights (qkv, o, gate_up, down) and its LM head, as a decode step
does (weights from DRAM; with --reuse the first layer's weights every time, from L3: the
kernel's compute without the weight stream), the two builds taking turns round by round. Prints, per M, the min
and median ms of each projection's 30 calls and of the whole pass, and whether the two builds'
outputs are bit for bit equal.
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import tempfile
import time

import torch

from benchmarks import ab_build
from benchmarks.gemm import LM_HEAD, SHAPES
from kernels.cpu_ops import int8, linear

_P, _I64, _I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
# llmsvc_gemm_f32 and its kin (a, lda, packed, bias, c, ldc, M, N, K, threads)
_ARGTYPES = [_P, _I64, _P, _P, _P, _I64, _I64, _I64, _I64, _I]
# llmsvc_gemm_i8(isa, a, lda, dtype, packed, bias, c, ldc, M, N, K, threads)
_I8_ARGTYPES = [_I, _P, _I64, _I, _P, _P, _P, _I64, _I64, _I64, _I64, _I]


def _call(fn, x, pw, out, m, n, k, threads) -> int:
    return fn(x.data_ptr(), k, pw.data_ptr(), None, out.data_ptr(), n, m, n, k, threads)


def _call_i8(fn, x, pw, out, m, n, k, threads) -> int:
    return fn(int8.ISAS.index(int8.isa()), x.data_ptr(), k, 1, pw.data_ptr(), None, out.data_ptr(), n, m, n, k,
              threads)


_GEMM_C = ["kernels/cpu_ops/gemm.c"]
GEMMS = {  # dtype: (sources, entry, packing, entry's argtypes, its call)
    "bfloat16": (["kernels/cpu_ops/gemm_bf16dp.c"], "llmsvc_gemm_bf16_dp", linear.pack_amx, _ARGTYPES, _call),
    "bfloat16-widen": (_GEMM_C, "llmsvc_gemm_bf16_widen", linear.pack_panels, _ARGTYPES, _call),
    "float32": (_GEMM_C, "llmsvc_gemm_f32", linear.pack_panels, _ARGTYPES, _call),
    "gguf": (_GEMM_C, "llmsvc_gemm_q8", lambda w: _gguf_blocks(w), _ARGTYPES, _call),
    "int8": ([f"kernels/cpu_ops/gemm_int8{part}.c" for part in ("", "_avx2", "_vnni", "_amx")], "llmsvc_gemm_i8",
             int8.pack, _I8_ARGTYPES, _call_i8),
}


def _gguf_blocks(w: torch.Tensor) -> torch.Tensor:
    """w [N, K] fp32 rounded to blocks of 32 as Q4_1 holds them (0..15 above each block's
    minimum, fp16 scale and minimum), packed by linear.pack_gguf_blocks."""
    n, k = w.shape
    b = w.reshape(n, k // 32, 32)
    lo = b.amin(-1).half().float()
    d = ((b.amax(-1) - lo) / 15).clamp_min(1e-8).half().float()
    q = ((b - lo[..., None]) / d[..., None]).round().clamp(0, 15)
    return linear.pack_gguf_blocks(q.to(torch.int8).reshape(n, k), d, lo)
_PANELS = ("llmsvc_gemm_f32", "llmsvc_gemm_bf16_widen")  # entries reading pack_panels' layout


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="HEAD", help="git revision of the other build (default HEAD)")
    ap.add_argument("--dtype", default="bfloat16", choices=list(GEMMS))
    ap.add_argument("--rows", default="1,16,64", help="comma-separated M values")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=25)
    ap.add_argument("--reuse", action="store_true", help="every layer multiplies the first layer's weights")
    a = ap.parse_args(argv)
    dtype = {"gguf": torch.float32, "int8": torch.bfloat16}.get(a.dtype) or getattr(torch, a.dtype.split("-")[0])
    paths, entry, pack, argtypes, call = GEMMS[a.dtype]
    g = torch.Generator().manual_seed(0)
    # (name, weight [N, K]) in the order a step calls them
    calls = [(name, w) for _ in range(1 if a.reuse else a.layers) for name, n, k in SHAPES
             for w in [(torch.randn(n, k, generator=g) * 0.02).to(dtype)]]
    calls *= a.layers if a.reuse else 1  # the same tensors again: packed once, read from cache
    calls.append(("lm_head", (torch.randn(*LM_HEAD, generator=g) * 0.02).to(dtype)))
    names = [n for n, _, _ in SHAPES] + ["lm_head"]
    with tempfile.TemporaryDirectory() as tmp:
        fns = ab_build.compile_pair(paths, a.base, tmp, entry, argtypes)
        packed = {tag: _pack_each_once(calls, pack, _layout(fn)) for tag, fn in fns.items()}
        print(f"{', '.join(paths)}, {a.dtype}, {a.threads} threads, {a.layers} layers + LM head")
        for m in (int(r) for r in a.rows.split(",")):
            xs = {k: torch.randn(m, k, generator=g).to(dtype) for k in {w.shape[1] for _, w in calls}}
            outs = {tag: [torch.empty(m, w.shape[0], dtype=dtype) for _, w in calls] for tag in fns}
            times = {tag: {n: [] for n in names + ["pass"]} for tag in fns}
            for _ in range(a.rounds + 1):  # round 0 warms up
                for tag, fn in fns.items():
                    per = dict.fromkeys(names, 0.0)
                    for (name, w), pw, out in zip(calls, packed[tag], outs[tag]):
                        x, (n, k) = xs[w.shape[1]], w.shape
                        t0 = time.perf_counter()
                        rc = call(fn, x, pw, out, m, n, k, a.threads)
                        per[name] += time.perf_counter() - t0
                        if rc != 0:
                            raise SystemExit(f"{tag}: {entry} refused (not built for this CPU?)")
                    for name, t in per.items():
                        times[tag][name].append(t)
                    times[tag]["pass"].append(sum(per.values()))
            same = all(torch.equal(x, y) for x, y in zip(*outs.values()))
            print(f"  M = {m}: bit for bit {'yes' if same else 'NO'}")
            for name in names + ["pass"]:
                cols = "   ".join(f"{tag}: min {1e3 * min(t[name][1:]):7.3f} median "
                                   f"{1e3 * statistics.median(t[name][1:]):7.3f} ms" for tag, t in times.items())
                print(f"    {name:<8} {cols}", flush=True)


def _pack_each_once(calls, pack, layout: tuple) -> list:
    """The packed weight of each call; a tensor that comes again (--reuse) is packed once."""
    done: dict[int, torch.Tensor] = {}
    for _, w in calls:
        if id(w) not in done:
            done[id(w)] = pack(w, *layout)
    return [done[id(w)] for _, w in calls]


def _layout(fn) -> tuple:
    """pack_panels' extra argument for this build: its fp32 sub-panel width (builds before the
    query existed: 48, one [K][48] block per panel); nothing for other packings."""
    query = getattr(fn.lib, "llmsvc_gemm_f32_subpanel", None) if fn.__name__ in _PANELS else None
    if query is None:
        return (48,) if fn.__name__ in _PANELS else ()
    query.restype, query.argtypes = ctypes.c_int, []
    return (query(),)


if __name__ == "__main__":
    main()
