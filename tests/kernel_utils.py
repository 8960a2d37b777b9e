"""Helpers for the kernel tests: NaN guard buffers, paged-cache batch builders, the AVX2-build probe,
the mark of tests that need the native library."""
from __future__ import annotations

import pytest
import torch

from kernels.cpu_ops import build

# LLMSVC_CPU_KERNELS=0 turns the native library off on purpose (every op then runs the torch
# reference), and a test of the library has nothing to run. With the library on, one that
# fails to build still fails these tests: they assert it loaded.
needs_native = pytest.mark.skipif(not build.enabled_by_env(),
                                  reason="LLMSVC_CPU_KERNELS=0 turns the native CPU kernels off")

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
       torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2)}
GUARD = 64  # NaN elements on each side of a guarded tensor


def guarded(t: torch.Tensor, device=None) -> torch.Tensor:
    """A contiguous copy of t inside a NaN-filled buffer (-1 for integer tensors) on `device`
    (default: t's): reads past either end see the guard."""
    fill = float("nan") if t.dtype.is_floating_point else -1
    buf = torch.full((t.numel() + 2 * GUARD,), fill, dtype=t.dtype, device=device or t.device)
    view = buf[GUARD:GUARD + t.numel()].view(t.shape)
    view.copy_(t)
    return view


def guarded_rows(t: torch.Tensor, pad: int = 8, device=None) -> torch.Tensor:
    """t [R, C] copied into a NaN buffer [R, C + pad] on `device` (default: t's) and sliced
    back: row stride C + pad."""
    buf = torch.full((t.shape[0] + 1, t.shape[1] + pad), float("nan"), dtype=t.dtype,
                     device=device or t.device)
    view = buf[:t.shape[0], :t.shape[1]]
    view.copy_(t)
    return view


class PagedBatch:
    """A mixed batch over a paged cache: every slot not owned by a sequence holds NaN.

    seqs: [(ctx, q_len)]; physical blocks are a random permutation; the block table is padded
    with the id of a NaN-only block. Inputs are drawn on the CPU (the same values on any
    device) and placed on `device`; `clean_args()` gives CPU copies with NaN replaced by 0,
    to compute the expected output from.
    """

    def __init__(self, seqs, num_q_heads, num_kv_heads, head_dim, block_size=16,
                 dtype=torch.float32, seed=0, spare_blocks=3, device="cpu"):
        g = torch.Generator().manual_seed(seed)
        self.seqs = seqs
        nblk = [(ctx + block_size - 1) // block_size for ctx, _ in seqs]
        num_blocks = sum(nblk) + spare_blocks
        perm = torch.randperm(num_blocks, generator=g)
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k_cache = guarded(torch.full(shape, float("nan"), dtype=dtype))
        self.v_cache = guarded(torch.full(shape, float("nan"), dtype=dtype))
        width = max(nblk) + 2
        spare = int(perm[-1])  # never owned: all NaN
        bt = torch.full((len(seqs), width), spare, dtype=torch.int32)
        used = 0
        for i, (ctx, q_len) in enumerate(seqs):
            assert 1 <= q_len <= ctx
            blocks = perm[used:used + nblk[i]]
            used += nblk[i]
            bt[i, :nblk[i]] = blocks.to(torch.int32)
            for pos in range(ctx):
                b, off = int(blocks[pos // block_size]), pos % block_size
                self.k_cache[b, off] = torch.randn(num_kv_heads, head_dim, generator=g).to(dtype)
                self.v_cache[b, off] = torch.randn(num_kv_heads, head_dim, generator=g).to(dtype)
        self.block_tables = guarded(bt)
        q_lens = [q for _, q in seqs]
        qsl = torch.zeros(len(seqs) + 1, dtype=torch.int32)
        qsl[1:] = torch.tensor(q_lens).cumsum(0)
        self.query_start_loc = guarded(qsl)
        self.seq_lens = guarded(torch.tensor([c for c, _ in seqs], dtype=torch.int32))
        t = int(qsl[-1])
        q = torch.randn(t, num_q_heads + 1, head_dim, generator=g).to(dtype)
        q[:, -1] = float("nan")  # an extra NaN head after the real ones: query has row stride Hq+1
        self.query = q[:, :num_q_heads]
        self.scale = head_dim ** -0.5
        self._cpu = (self.query, self.k_cache, self.v_cache, self.block_tables,
                     self.query_start_loc, self.seq_lens)
        if torch.device(device).type != "cpu":
            self.query = q.to(device)[:, :num_q_heads]
            self.k_cache, self.v_cache, self.block_tables, self.query_start_loc, self.seq_lens = (
                guarded(t, device) for t in self._cpu[1:])

    def forget_before_window(self, window: int) -> None:
        """NaN in every slot before each sequence's first window start (ctx - q_len + 1 -
        window), as when those blocks were freed and handed to another sequence: a kernel
        honouring the window never reads them, so the expected output is unchanged."""
        bs = self.k_cache.shape[1]
        for i, (ctx, q_len) in enumerate(self.seqs):
            for pos in range(max(0, ctx - q_len + 1 - window)):
                b = int(self.block_tables[i, pos // bs])
                self.k_cache[b, pos % bs] = float("nan")
                self.v_cache[b, pos % bs] = float("nan")

    def args(self):
        return (self.query, self.k_cache, self.v_cache, self.block_tables, self.query_start_loc,
                self.seq_lens, self.scale)

    def clean_args(self):
        query, k_cache, v_cache, block_tables, query_start_loc, seq_lens = self._cpu
        return (query.contiguous(), torch.nan_to_num(k_cache, nan=0.0),
                torch.nan_to_num(v_cache, nan=0.0), block_tables.clone(),
                query_start_loc.clone(), seq_lens.clone(), self.scale)


def run_avx2_build_probe(code: str) -> None:
    """Runs `code` in a fresh process whose native kernels are built for AVX2 (LLMSVC_CPU_ISA=avx2;
    the cap is part of the build's cache key, so the build is shared with every other AVX2-capped
    process): the paths an AVX2 CPU without AVX-512 runs, which an AVX-512 machine would not.
    The code prints "ok" last. Skips without a C compiler or AVX2 + FMA."""
    import os
    import subprocess
    import sys

    import pytest

    from kernels.cpu_ops import build, isa

    if build._compiler() is None or isa.cpu_level() in (None, "sse4"):
        pytest.skip("no C compiler, or no AVX2 + FMA on this CPU")
    env = {**os.environ, isa.ENV: "avx2"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                       env=env, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]
