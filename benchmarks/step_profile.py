"""Where one engine step's time goes, against the bytes it must read.

    python -m benchmarks.step_profile [--dtype bfloat16] [--seqs 64] [--context 192]
                                      [--prefill 1024] [--repeats 10]

Drives the worker's `ModelRunner` with hand-made scheduler outputs on the default model (or --model):
  decode   --seqs greedy requests at --context keys, one token each per step (the cache holds
           whatever the blocks hold: the bytes read, not the values, set the time)
  prefill  --prefill prompt tokens in requests of --prompt-len (128) from an empty cache (one sample each)
For each it prints the step's wall time (min / median of --repeats steps) split into:
  inputs   build_inputs (flattening the batch, block tables, slot mapping)
  model    embedding, decoder layers and final norm; when the layers take the one-call
           native path (decoder.c), also per kind of kernel call, summed over the layers: norms,
           the qkv / o / gate_up / down GEMMs, RoPE, the KV store, attention, SiLU-and-mul, in
           wall time and in the calling thread's CPU time ("cpu": not inflated while other
           processes hold the core; the whole work with --threads 1)
  lm_head, sampler, and "other" (the rest of execute_model: state updates, sampling
           metadata, Python between the parts); "step cpu" is the calling thread's CPU time
and the step's memory floor: its weights (+ the LM head) and its sequences' K/V read once at
the read bandwidth measured in the same run (llmsvc/bench/ceiling.py).
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch

from kernels.cpu_ops import decoder
from llmsvc.bench import ceiling, engine_steps
from llmsvc.config import QUANTIZATION_CHOICES
from llmsvc.worker import model_runner as mr_module


class PhaseTimer:
    """Wraps callables so that each call adds its wall seconds to `seconds[name]`."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - t0
        return timed


def instrument(runner, timer: PhaseTimer):
    """Times the parts of execute_model; the native layers' plan accumulates its kernels.
    Returns what undoes the one change outside `runner` (the model runner module's
    build_inputs)."""
    model, build_inputs = runner.model, mr_module.build_inputs
    mr_module.build_inputs = timer.wrap("inputs", build_inputs)
    model.compute_logits = timer.wrap("lm_head", model.compute_logits)
    runner.sampler.forward = timer.wrap("sampler", runner.sampler.forward)
    inner = model.model
    inner.forward = timer.wrap("model", inner.forward)
    if inner._native_plan is not None:
        inner._native_plan.enable_profile()

    def undo():
        mr_module.build_inputs = build_inputs
    return undo


def run_steps(runner, timer: PhaseTimer, steps) -> list[dict]:
    """Per step: {part: seconds}; "step" is the whole execute_model, "step cpu" its thread CPU."""
    plan = runner.model.model._native_plan
    rows = []

    def around():
        timer.seconds.clear()
        if plan is not None and plan.profile is not None:
            plan.profile.zero_()
        c0 = time.thread_time()

        def after():
            row = dict(timer.seconds, **{"step cpu": time.thread_time() - c0})
            if plan is not None and plan.profile is not None and plan.profile.any():  # ran natively
                wall, cpu = plan.profile.tolist()
                row.update({f"  {k}": v for k, v in zip(decoder.PROFILE_KINDS, wall)})
                row.update({f"  {k} cpu": v for k, v in zip(decoder.PROFILE_KINDS, cpu)})
            rows.append(row)
        return after

    for row, seconds in zip(rows, engine_steps.run_steps(runner, steps, around)):
        row["step"] = seconds
    return rows


def report(title: str, rows: list[dict], floor: dict) -> None:
    step_min = min(r["step"] for r in rows)
    print(f"\n{title}: {len(rows)} steps, step min {step_min * 1e3:.1f} ms, median "
          f"{statistics.median(r['step'] for r in rows) * 1e3:.1f} ms; memory floor "
          f"{floor['min_seconds'] * 1e3:.1f} ms ({floor['weight_mb']:.0f} MB weights + {floor['kv_mb']:.0f} MB "
          f"K/V at {floor['read_gb_s']:.1f} GB/s) -> {step_min / floor['min_seconds']:.2f} x the floor")
    for r in rows:  # what no part covers
        r["other"] = r["step"] - sum(r.get(k, 0.0) for k in ("inputs", "model", "lm_head", "sampler"))
    order = ["inputs", "model", *(f"  {k}{c}" for k in decoder.PROFILE_KINDS for c in ("", " cpu")),
             "lm_head", "sampler", "other", "step", "step cpu"]
    med_step = statistics.median(r["step"] for r in rows)
    for k in order:
        vals = [r[k] for r in rows if k in r]
        if not vals:
            continue
        med = statistics.median(vals)
        print(f"  {k:<12} min {min(vals) * 1e3:8.2f}  median {med * 1e3:8.2f} ms  {100 * med / med_step:5.1f}%")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--context", type=int, default=192, help="keys per sequence at the first decode step")
    ap.add_argument("--prefill", type=int, default=1024, help="prompt tokens in the prefill step (0: none)")
    ap.add_argument("--prompt-len", type=int, default=128, help="tokens per prompt of the prefill step (S1: 256)")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--threads", type=int, default=0, help="torch / kernel threads (0: every core)")
    ap.add_argument("--model", default=None, help="HF directory or .gguf (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--quantization", default="auto", choices=list(QUANTIZATION_CHOICES), help="as `llmsvc serve`'s")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    runner = engine_steps.make_cpu_runner(a.dtype, max(engine_steps.decode_blocks(a.seqs, a.context, a.repeats),
                                                         a.prefill // engine_steps.BLOCK_SIZE + 16), a.model,
                                         a.quantization)
    mc = runner.config.model_config
    counts = ceiling.param_counts(mc.model_dir)
    esz = torch.empty((), dtype=runner.dtype).element_size()
    kv_tok = ceiling.kv_bytes_per_token(mc.model_dir, esz)
    bw = ceiling.read_bandwidth(device="cpu")
    timer = PhaseTimer()
    undo = instrument(runner, timer)
    try:
        _run(a, runner, timer, counts, esz, kv_tok, bw)
    finally:
        undo()


def _run(a, runner, timer: PhaseTimer, counts: dict, esz: int, kv_tok: int, bw: float) -> None:
    mc = runner.config.model_config
    native = runner.model.model._native_plan is not None
    print(f"{mc.served_model_name} {a.dtype}, quantization {mc.quantization}, {torch.get_num_threads()} threads, "
          f"native layers: {native}")
    rows = run_steps(runner, timer, engine_steps.decode_steps(runner, a.seqs, a.context, a.repeats))
    ctx = a.context + a.repeats // 2  # the keys of the median step
    wb = ceiling.stored_weight_bytes(runner)
    report(f"decode, {a.seqs} sequences at {a.context}-{a.context + a.repeats} keys", rows,
           ceiling.step_floor(counts, kv_tok, esz, a.seqs * ctx, bw, wb))
    if a.prefill:
        rows = run_steps(runner, timer, engine_steps.prefill_steps(runner, a.prefill, a.repeats,
                                                                   prompt_len=a.prompt_len))
        n = max(1, a.prefill // a.prompt_len)
        # a causal prefill reads its own new K/V back: each of n prompts, prompt_len rows per layer
        report(f"prefill, {n} x {a.prompt_len} prompt tokens", rows,
               ceiling.step_floor(counts, kv_tok, esz, n * a.prompt_len, bw, wb))


if __name__ == "__main__":
    main()
