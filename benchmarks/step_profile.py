"""Where one engine step's time goes, against the bytes it must read.

    python -m benchmarks.step_profile [--dtype bfloat16] [--seqs 64] [--context 192]
                                      [--prefill 1024] [--repeats 10]

Drives the worker's `ModelRunner` with hand-made scheduler outputs on the default model:
  decode   --seqs greedy requests at --context keys, one token each per step (the cache holds
           whatever the blocks hold: the bytes read, not the values, set the time)
  prefill  --prefill prompt tokens in requests of 128 from an empty cache (one sample each)
For each it prints the step's wall time (min / median of --repeats steps) split into:
  inputs   build_inputs (flattening the batch, block tables, slot mapping)
  layers   the decoder layers; with the one-call native path (decoder.c) also split per kind
           of kernel call: norms, the qkv / o / gate_up / down GEMMs, RoPE, the KV store,
           attention, SiLU-and-mul, as summed over the 30 layers inside that call
  embed+norm, lm_head, sampler, and "other" (the rest of execute_model: state updates,
           sampling metadata, Python between the parts)
and the step's memory floor: its weights (+ the LM head) and its sequences' K/V read once at
the read bandwidth measured in the same run (llmsvc/bench/ceiling.py).
"""
from __future__ import annotations

import argparse
import random
import statistics
import time
from collections import defaultdict

import torch

from kernels import ops
from kernels.cpu_ops import decoder
from llmsvc.bench import ceiling
from llmsvc.config import EngineConfig
from llmsvc.sampling_params import SamplingParams
from llmsvc.wire import CachedRequestData, NewRequestData, SchedulerOutput
from llmsvc.worker import host_malloc
from llmsvc.worker import model_runner as mr_module
from llmsvc.worker.model_runner import ModelRunner

PREFILL_PROMPT = 128  # tokens per request in the prefill step (W1's prompt length)


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


def make_runner(dtype: str, num_blocks: int) -> ModelRunner:
    config = EngineConfig.from_options(dtype=dtype, device="cpu")
    from llmsvc.models.resolve import resolve_model_config
    config.model_config = resolve_model_config(config.model_config)
    runner = ModelRunner(config, torch.device("cpu"))
    runner.load_model()
    runner.initialize_kv_cache(num_blocks)
    host_malloc.keep_activations_mapped()  # as the worker does once its caches are in place
    runner.warmup()
    return runner


def instrument(runner: ModelRunner, timer: PhaseTimer) -> None:
    """Times the parts of execute_model; the native layers' plan accumulates its kernels."""
    model = runner.model
    mr_module.build_inputs = timer.wrap("inputs", mr_module.build_inputs)
    model.compute_logits = timer.wrap("lm_head", model.compute_logits)
    runner.sampler.forward = timer.wrap("sampler", runner.sampler.forward)
    inner = model.model
    ops.decoder_layers = timer.wrap("layers", ops.decoder_layers)
    inner.forward = timer.wrap("model", inner.forward)
    if inner._native_plan is not None:
        inner._native_plan.profile = torch.zeros((2, len(decoder.PROFILE_KINDS)), dtype=torch.float64)


def new_request(req_id: str, prompt: list[int], blocks: list[int], num_computed: int) -> NewRequestData:
    return NewRequestData(req_id, prompt, [], SamplingParams(temperature=0.0, max_tokens=1 << 20),
                          blocks, num_computed)


def decode_steps(runner: ModelRunner, seqs: int, context: int, repeats: int, rng: random.Random):
    """Yields once per timed decode step, after `execute_model` returned."""
    bs = runner.block_size
    per_seq = -(-(context + repeats + 2) // bs)
    blocks = list(range(seqs * per_seq))
    rng.shuffle(blocks)  # a sequence's blocks scattered, as after a while of serving
    so = SchedulerOutput.make_empty()
    for i in range(seqs):
        prompt = [rng.randrange(3, 30000) for _ in range(context)]
        so.scheduled_new_reqs.append(new_request(f"d{i}", prompt, blocks[i * per_seq:(i + 1) * per_seq],
                                                 context - 1))
        so.num_scheduled_tokens[f"d{i}"] = 1
    so.total_num_scheduled_tokens = seqs
    out = runner.execute_model(so)
    computed = context
    for _ in range(repeats):
        so = SchedulerOutput.make_empty()
        so.scheduled_cached_reqs = CachedRequestData(
            list(out.req_ids), [[t] for t in out.sampled_token_ids], [[] for _ in out.req_ids],
            [computed] * len(out.req_ids))
        so.num_scheduled_tokens = {r: 1 for r in out.req_ids}
        so.total_num_scheduled_tokens = len(out.req_ids)
        yield so
        out = runner.last_output
        computed += 1


def prefill_steps(runner: ModelRunner, tokens: int, repeats: int, rng: random.Random):
    bs = runner.block_size
    n = max(1, tokens // PREFILL_PROMPT)
    per_seq = -(-PREFILL_PROMPT // bs)
    prev: set[str] = set()
    for step in range(repeats):
        so = SchedulerOutput.make_empty()
        so.finished_req_ids = prev
        for i in range(n):
            prompt = [rng.randrange(3, 30000) for _ in range(PREFILL_PROMPT)]
            rid = f"p{step}.{i}"
            so.scheduled_new_reqs.append(new_request(rid, prompt, list(range(i * per_seq, (i + 1) * per_seq)), 0))
            so.num_scheduled_tokens[rid] = PREFILL_PROMPT
        so.total_num_scheduled_tokens = n * PREFILL_PROMPT
        prev = set(so.num_scheduled_tokens)
        yield so


def run_steps(runner: ModelRunner, timer: PhaseTimer, steps) -> list[dict]:
    """Per step: {part: seconds}, "step" the whole execute_model."""
    plan = runner.model.model._native_plan
    rows = []
    for so in steps:
        timer.seconds.clear()
        if plan is not None and plan.profile is not None:
            plan.profile.zero_()
        t0, c0 = time.perf_counter(), time.thread_time()
        runner.last_output = runner.execute_model(so)
        row = dict(timer.seconds, step=time.perf_counter() - t0, **{"step cpu": time.thread_time() - c0})
        if plan is not None and plan.profile is not None and row.get("layers"):
            wall, cpu = plan.profile.tolist()
            row.update({f"  {k}": v for k, v in zip(decoder.PROFILE_KINDS, wall)})
            row.update({f"  {k} cpu": v for k, v in zip(decoder.PROFILE_KINDS, cpu)})
        rows.append(row)
    return rows


def report(title: str, rows: list[dict], floor: dict) -> None:
    step_min = min(r["step"] for r in rows)
    print(f"\n{title}: {len(rows)} steps, step min {step_min * 1e3:.1f} ms, median "
          f"{statistics.median(r['step'] for r in rows) * 1e3:.1f} ms; memory floor "
          f"{floor['min_seconds'] * 1e3:.1f} ms ({floor['weight_mb']:.0f} MB weights + {floor['kv_mb']:.0f} MB "
          f"K/V at {floor['read_gb_s']:.1f} GB/s) -> {step_min / floor['min_seconds']:.2f} x the floor")
    for r in rows:  # derived parts: the model's embedding + final norm, and what no part covers
        r["embed+norm"] = r.get("model", 0.0) - r.get("layers", 0.0)
        r["other"] = r["step"] - sum(r.get(k, 0.0) for k in ("inputs", "model", "lm_head", "sampler"))
    order = ["inputs", "layers", *(f"  {k}{c}" for k in decoder.PROFILE_KINDS for c in ("", " cpu")),
             "embed+norm", "lm_head", "sampler", "other", "step", "step cpu"]
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
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--threads", type=int, default=0, help="torch / kernel threads (0: every core)")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    rng = random.Random(0)
    per_seq = -(-(a.context + a.repeats + 2) // 16)
    runner = make_runner(a.dtype, max(a.seqs * per_seq, a.prefill // 16 + 16))
    mc = runner.config.model_config
    counts = ceiling.param_counts(mc.model_dir)
    esz = torch.empty((), dtype=runner.dtype).element_size()
    kv_tok = ceiling.kv_bytes_per_token(mc.model_dir, esz)
    bw = ceiling.read_bandwidth(device="cpu")
    timer = PhaseTimer()
    instrument(runner, timer)
    native = runner.model.model._native_plan is not None
    print(f"{mc.served_model_name} {a.dtype}, {torch.get_num_threads()} threads, native layers: {native}")
    rows = run_steps(runner, timer, decode_steps(runner, a.seqs, a.context, a.repeats, rng))
    ctx = a.context + a.repeats // 2  # the keys of the median step
    report(f"decode, {a.seqs} sequences at {a.context}-{a.context + a.repeats} keys", rows,
           ceiling.step_floor(counts, kv_tok, esz, a.seqs * ctx, bw))
    if a.prefill:
        rows = run_steps(runner, timer, prefill_steps(runner, a.prefill, a.repeats, rng))
        n = max(1, a.prefill // PREFILL_PROMPT)
        # a causal prefill reads its own new K/V back: each of n prompts, 128 rows per layer
        report(f"prefill, {n} x {PREFILL_PROMPT} prompt tokens", rows,
               ceiling.step_floor(counts, kv_tok, esz, n * PREFILL_PROMPT, bw))


if __name__ == "__main__":
    main()
