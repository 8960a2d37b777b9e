"""The arithmetic ceiling of a workload on this machine: measured GEMM FLOP/s vs model FLOPs.

A prompt token costs 2 x (parameters without the embedding) FLOPs, a generated token
2 x (all parameters, LM head included): attention's own FLOPs are left out (the ceiling counts the GEMMs only).

Beside it, the memory floor: bytes no schedule can avoid reading, at the read bandwidth
measured in the same run. Every decode step reads every weight once (at least output_len - 1
steps), and the step that makes a request's token j + 1 reads the K/V of its input_len + j
cache rows in every layer. A decode-heavy workload in bf16 can be bound by these bytes rather
than by the GEMM rate; the K/V reads, which the FLOP ceiling leaves out, also say how long
attention must take at the least.
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


def _best_seconds(fn, sync, repeats: int) -> float:
    """Fastest of `repeats` timed calls of fn (each waited for with sync), after one warm-up."""
    fn()
    sync()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def arithmetic_dtype(dtype: str, device: str = "auto") -> str:
    """The dtype the engine's GEMMs compute in: `dtype`, except bf16 on a CPU without bf16
    arithmetic (no AVX512-BF16 / AMX), whose packed GEMM widens bf16 to fp32
    (kernels/cpu_ops/gemm.c): there torch.mm in bf16 runs oneDNN's emulation (AVX-512) or a
    slow fallback (AVX2), and the fp32 rate is the ceiling. Without our library: oneDNN's bf16
    where it has one."""
    import torch

    dev, _ = bench_device(device)
    if dtype != "bfloat16" or dev.type != "cpu":
        return dtype
    from kernels.cpu_ops import linear

    layout = linear.bf16_layout()  # "vnni": AMX / AVX512-BF16; "panels": widened to fp32
    if layout:
        return dtype if layout == "vnni" else "float32"
    return dtype if torch.ops.mkldnn._is_mkldnn_bf16_supported() else "float32"


def gemm_flops(dtype: str = "float32", n: int = 4096, repeats: int = 3, device: str = "auto") -> float:
    """Best-of-`repeats` FLOP/s of an n x n x n matmul in `dtype` on the engine's device (auto:
    the GPU where there is one, else the CPU with all its threads). fp32 on a GPU is plain
    fp32 (no TF32), as the engine computes it."""
    import torch

    device, sync = bench_device(device)
    from llmsvc.models.loader import to_torch_dtype

    dt = to_torch_dtype(dtype)
    a, b = (torch.randn(n, n, dtype=dt, device=device) for _ in range(2))
    return 2 * n ** 3 / _best_seconds(lambda: torch.mm(a, b), sync, repeats)


def ceiling(w: Workload, counts: dict, flops_per_s: float) -> dict:
    """Fastest possible run of workload `w`: its FLOPs at the GEMM rate."""
    prompt = w.total_prompt_tokens * counts["prompt_flops_per_token"]
    gen = w.total_output_tokens * counts["gen_flops_per_token"]
    seconds = (prompt + gen) / flops_per_s
    return {"gemm_gflops": flops_per_s / 1e9, "workload_tflop": (prompt + gen) / 1e12,
            "min_seconds": seconds, "output_tok_s": w.total_output_tokens / seconds}


def kv_bytes_per_token(model_dir: str, dtype_bytes: int) -> int:
    """K and V of one token in every layer: 2 x layers x KV heads x head_dim x dtype size, the
    shapes the worker allocates its caches with (one rank)."""
    from transformers import AutoConfig

    from llmsvc.models.llama import kv_cache_spec

    layers, kv_heads, head_dim = kv_cache_spec(AutoConfig.from_pretrained(model_dir), tp_size=1)
    return 2 * layers * kv_heads * head_dim * dtype_bytes


def read_bandwidth(n_bytes: int = 1 << 29, repeats: int = 3, device: str = "auto") -> float:
    """Best-of-`repeats` bytes/s of summing an `n_bytes` fp32 buffer (far larger than the CPU
    caches) on the engine's device, all threads."""
    import torch

    device, sync = bench_device(device)
    x = torch.ones(n_bytes // 4, dtype=torch.float32, device=device)
    return n_bytes / _best_seconds(x.sum, sync, repeats)


def memory_floor(w: Workload, counts: dict, kv_token_bytes: int, dtype_bytes: int,
                 bytes_per_s: float, weight_bytes: int | None = None) -> dict:
    """Fewest bytes workload `w` must read (weights once per decode step, every decode step's
    K/V) and the time they take at `bytes_per_s`; `weight_bytes`: a step's weights where they
    are not stored at the compute dtype (GGUF blocks, int8: multiplied_weight_bytes)."""
    steps = max(w.output_len - 1, 0)
    per_step = counts["gen_flops_per_token"] // 2 * dtype_bytes if weight_bytes is None else weight_bytes
    weights = steps * per_step  # body + LM head
    rows = steps * w.input_len + steps * (steps + 1) // 2  # sum of input_len + j, j = 1 .. steps
    kv = w.num_requests * rows * kv_token_bytes
    seconds = (weights + kv) / bytes_per_s
    return {"read_gb_s": bytes_per_s / 1e9, "weight_read_gb": weights / 1e9, "kv_read_gb": kv / 1e9,
            "min_seconds": seconds, "kv_seconds": kv / bytes_per_s,
            "output_tok_s": w.total_output_tokens / seconds if seconds else float("inf")}



def step_floor(counts: dict, kv_token_bytes: int, dtype_bytes: int, context_rows: int,
               bytes_per_s: float, weight_bytes: int | None = None) -> dict:
    """Fewest bytes one sampling step must read: every weight once, the LM head included (as
    `weight_bytes` says where the weights are not stored at the compute dtype: GGUF blocks),
    and the K/V of `context_rows` cache rows summed over its sequences (64 decodes at 192 keys:
    64 * 192), and the time they take at `bytes_per_s`."""
    weights = counts["gen_flops_per_token"] // 2 * dtype_bytes if weight_bytes is None else weight_bytes
    kv = context_rows * kv_token_bytes
    return {"weight_mb": weights / 1e6, "kv_mb": kv / 1e6, "read_gb_s": bytes_per_s / 1e9,
            "min_seconds": (weights + kv) / bytes_per_s}


def multiplied_weight_bytes(model) -> int:
    """Bytes of the weights a step multiplies as the CPU GEMMs read them: GGUF blocks and int8
    weights as packed (int8 panels + scales), every other multiplied weight at its dtype."""
    import torch

    total = 0
    for m in model.modules():
        w, p = getattr(m, "weight", None), getattr(m, "packed_weight", None)
        if isinstance(w, torch.Tensor) and hasattr(m, "packed_weight"):
            total += p.numel() if p is not None and p.dtype in (torch.uint8, torch.int8) else w.numel() * w.element_size()
    return total


def stored_weight_bytes(runner) -> int | None:
    """multiplied_weight_bytes of a runner's model where its weights are quantized (GGUF blocks,
    int8), else None: dense weights are read at the compute dtype, which the floors count."""
    return None if runner.config.model_config.quantization == "none" else multiplied_weight_bytes(runner.model)


def decode_step(model: str | None, dtype: str, bytes_per_s: float, seqs: int = 64, context: int = 192,
                steps: int = 5, quantization: str = "none") -> dict | None:
    """The fastest of `steps` CPU decode steps of `seqs` sequences at ~`context` keys
    (llmsvc/bench/engine_steps.py) against that step's memory floor; None where the engine
    runs on a GPU. `model` as the engine takes it (a .gguf, for GGUF blocks; None: the default).
    "weight_bytes": stored_weight_bytes of its engine."""
    from llmsvc.bench import engine_steps

    if bench_device()[0].type != "cpu":
        return None
    runner = engine_steps.make_cpu_runner(dtype, engine_steps.decode_blocks(seqs, context, steps), model,
                                          quantization)
    seconds = min(engine_steps.run_steps(runner, engine_steps.decode_steps(runner, seqs, context, steps)))
    nb = runner.kv_caches[0][0].element_size()
    model_dir, wb = runner.config.model_config.model_dir, stored_weight_bytes(runner)
    floor = step_floor(param_counts(model_dir), kv_bytes_per_token(model_dir, nb), nb,
                       seqs * (context + steps // 2), bytes_per_s, wb)
    return {"seqs": seqs, "context": context, "step_ms": seconds * 1e3, "weight_bytes": wb,
            "floor_ms": floor["min_seconds"] * 1e3, "ratio": seconds / floor["min_seconds"]}
