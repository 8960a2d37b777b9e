"""Two builds of the CPU paged attention, side by side in one process, called alternately.

    python -m benchmarks.attention_ab [--base REV] [--threads 2] [--rounds 25] [--dtype bfloat16]
                                      [--layers 30]

Compiles `kernels/cpu_ops/paged_attention.c` and its `attention_item_*.c` as committed at --base
(default HEAD) and as they are in the working tree, each into its own library with the engine's
flags, loads both, and times a step's layers of attention (30 by default, the default model's:
9 query heads, 3 KV heads of 64, blocks of 16 in shuffled order, K/V from DRAM) for a few step
shapes, the two builds taking turns round by round. A slow phase of a shared machine (its
memory bandwidth swings from minute to minute) hits both alike, which separate runs of
`benchmarks.step_profile` cannot promise. Prints the min and median ms of a step's calls and
whether the two outputs are bit for bit equal (if not, their largest difference).
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import tempfile
import time

import torch

from benchmarks import ab_build

_SRC = ["kernels/cpu_ops/paged_attention.c", "kernels/cpu_ops/attention_item_*.c"]
HQ, HKV, D, BS = 9, 3, 64, 16
SHAPES = {  # name: [(context, query rows)] per sequence
    "decode 64 x ~200": [(200 + i % 8, 1) for i in range(64)],
    "decode 16 x ~200": [(200 + i % 8, 1) for i in range(16)],
    "prefill 1 x 256": [(256, 256)],
    "prefill 8 x 128": [(128, 128)] * 8,
    "prefill 1 x 1024": [(1024, 1024)],
    "chunk 256 after 768": [(1024, 256)],
}
_ARGTYPES = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
             ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
             ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_float,
             ctypes.c_int64, ctypes.c_float, ctypes.c_void_p, ctypes.c_int]


def _batch(seqs, dtype, gen, num_layers):
    """Per-layer caches and queries, and the shared block table / lengths."""
    nblk = sum(-(-c // BS) for c, _ in seqs)
    maxb = max(-(-c // BS) for c, _ in seqs)
    perm, bt, k = torch.randperm(nblk, generator=gen).tolist(), torch.zeros(len(seqs), maxb, dtype=torch.int32), 0
    for i, (c, _) in enumerate(seqs):
        for j in range(-(-c // BS)):
            bt[i, j], k = perm[k], k + 1
    qlens = [q for _, q in seqs]
    qsl = torch.tensor([0] + torch.tensor(qlens).cumsum(0).tolist(), dtype=torch.int32)
    sl = torch.tensor([c for c, _ in seqs], dtype=torch.int32)
    layers = [tuple(torch.randn(*shape, generator=gen).to(dtype)
                    for shape in ((nblk, BS, HKV, D), (nblk, BS, HKV, D), (sum(qlens), HQ, D)))
              for _ in range(num_layers)]
    return layers, bt, qsl, sl


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="HEAD", help="git revision of the other build (default HEAD)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--rounds", type=int, default=25)
    ap.add_argument("--layers", type=int, default=30, help="attention calls per step (default 30, the default model's)")
    a = ap.parse_args(argv)
    dtype = getattr(torch, a.dtype)
    with tempfile.TemporaryDirectory() as tmp:
        fns = ab_build.compile_pair(_SRC, a.base, tmp, "llmsvc_paged_attention", _ARGTYPES)
        print(f"{a.dtype}, {a.threads} threads, {a.layers} layers per step, {HQ} x {HKV} heads of {D}")
        for name, seqs in SHAPES.items():
            layers, bt, qsl, sl = _batch(seqs, dtype, torch.Generator().manual_seed(0), a.layers)
            outs = {tag: [torch.empty_like(q) for _, _, q in layers] for tag in fns}
            times = {tag: [] for tag in fns}
            for _ in range(a.rounds + 1):  # round 0 warms up
                for tag, fn in fns.items():
                    t0 = time.perf_counter()
                    for (kc, vc, q), out in zip(layers, outs[tag]):
                        rc = fn(int(dtype == torch.bfloat16), q.data_ptr(), HQ * D, kc.data_ptr(), vc.data_ptr(),
                                bt.data_ptr(), bt.shape[1], qsl.data_ptr(), sl.data_ptr(), len(seqs), HQ, HKV,
                                D, BS, D ** -0.5, 0, 0.0, out.data_ptr(), a.threads)
                        assert rc == 0, f"{tag}: rejected its arguments"
                    times[tag].append(time.perf_counter() - t0)
            same = all(torch.equal(x, y) for x, y in zip(*outs.values()))
            diff = max((x.float() - y.float()).abs().max().item() for x, y in zip(*outs.values()))
            cols = "   ".join(f"{tag}: min {1e3 * min(t[1:]):6.2f} median {1e3 * statistics.median(t[1:]):6.2f} ms"
                               for tag, t in times.items())
            print(f"  {name:<18} {cols}   bit for bit: {'yes' if same else f'no, max |diff| {diff:.2e}'}", flush=True)


if __name__ == "__main__":
    main()
