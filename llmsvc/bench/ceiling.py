"""The arithmetic ceiling of a workload on this machine: measured GEMM FLOP/s vs model FLOPs.

A prompt token costs 2 x (parameters without the embedding) FLOPs, a generated token
2 x (all parameters, LM head included): attention's own FLOPs are left out, as in the issue.
"""
from __future__ import annotations

import time
from pathlib import Path

from llmsvc.bench.workloads import Workload


def param_counts(model_dir: str) -> dict:
    """Parameter counts from the safetensors headers (no weights loaded)."""
    from safetensors import safe_open

    total = embed = head = 0
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(f), framework="numpy") as st:
            for name in st.keys():
                n = 1
                for d in st.get_slice(name).get_shape():
                    n *= d
                total += n
                if name.endswith("embed_tokens.weight"):
                    embed = n
                elif name.endswith("lm_head.weight"):
                    head = n
    tied = head == 0
    lm_head = embed if tied else head
    body = total - embed - head  # everything a prompt token multiplies through
    return {"total": total, "embedding": embed, "lm_head": lm_head, "tied": tied,
            "prompt_flops_per_token": 2 * body, "gen_flops_per_token": 2 * (body + lm_head)}


def bench_device(device: str = "auto"):
    """(torch.device, sync) for a peer measurement: "auto" is the engine's default (the GPU
    where there is one); sync() waits for the device's queued work (a no-op on the CPU)."""
    import torch

    from llmsvc.worker.worker import resolve_device

    dev = resolve_device(device)
    return dev, (torch.cuda.synchronize if dev.type == "cuda" else (lambda: None))


def gemm_flops(dtype: str = "float32", n: int = 4096, repeats: int = 3, device: str = "auto") -> float:
    """Best-of-`repeats` FLOP/s of an n x n x n matmul in `dtype` on the engine's device (auto:
    the GPU where there is one, else the CPU with all its threads). fp32 on a GPU is plain
    fp32 (no TF32), as the engine computes it."""
    import torch

    device, sync = bench_device(device)
    dt = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    a, b = (torch.randn(n, n, dtype=dt, device=device) for _ in range(2))
    torch.mm(a, b)  # warm up
    sync()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b)
        sync()
        best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best


def ceiling(w: Workload, counts: dict, flops_per_s: float) -> dict:
    """Fastest possible run of workload `w`: its FLOPs at the GEMM rate."""
    prompt = w.total_prompt_tokens * counts["prompt_flops_per_token"]
    gen = w.total_output_tokens * counts["gen_flops_per_token"]
    seconds = (prompt + gen) / flops_per_s
    return {"gemm_gflops": flops_per_s / 1e9, "workload_tflop": (prompt + gen) / 1e12,
            "min_seconds": seconds, "output_tok_s": w.total_output_tokens / seconds}
