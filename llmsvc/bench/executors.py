"""Executor benchmark: one workload (default W2) through an in-process LLMEngine per executor, one
after another, in one run. Prints output tok/s side by side and the per-step IPC cost:

  overhead/step = (time in executor.execute_model - the worker's own execute_model time) / steps
  bytes/step    = len(pickle(SchedulerOutput)), for decode-only steps and for all steps

    python -m llmsvc.bench.executors [MODEL] --executors uniproc,multiproc,tp --tensor-parallel-size 2
    llmsvc bench --executors uniproc,multiproc,tp          (the same, from the bench command)
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import pickle
import sys
import time

from executors.registry import TENSOR_PARALLEL, executor_names
from llmsvc.bench.metrics import summarize
from llmsvc.bench.workloads import Workload, arrival_offsets, build_prompts, get_workload, ordinary_vocab


class TimedExecutor:
    """Wraps an executor: wall time of each execute_model call and the pickled size of its input."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.num_steps = 0
        self.time_s = 0.0
        self.bytes_all = 0
        self.decode_steps = 0
        self.decode_bytes = 0
        self.decode_reqs = 0  # requests summed over decode steps

    def execute_model(self, so):
        t0 = time.perf_counter()
        out = self.inner.execute_model(so)
        self.time_s += time.perf_counter() - t0
        self.num_steps += 1
        n = len(pickle.dumps(so, protocol=pickle.HIGHEST_PROTOCOL))  # outside the timed region
        self.bytes_all += n
        if not so.scheduled_new_reqs and all(v == 1 for v in so.num_scheduled_tokens.values()):
            self.decode_steps += 1
            self.decode_bytes += n
            self.decode_reqs += len(so.num_scheduled_tokens)
        return out

    def __getattr__(self, name):
        return getattr(self.inner, name)


def engine_config(a, executor: str):
    from llmsvc.config import EngineConfig

    tp = a.tensor_parallel_size if executor == TENSOR_PARALLEL else 1
    return EngineConfig.from_options(model=a.model, dtype=a.dtype, kv_cache_memory=a.kv_cache_memory,
                                     max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens,
                                     executor=executor, tensor_parallel_size=tp, device=a.device,
                                     log_stats_interval_s=0.0)


def run_one(a, executor: str, w: Workload, prompts: list[list[int]]) -> dict:
    from llmsvc.bench.runners import run_offline
    from llmsvc.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_config(engine_config(a, executor))
    timed = TimedExecutor(engine.core.executor)
    engine.core.executor = timed
    try:
        before = timed.inner.execute_stats()
        t_before, s_before = timed.time_s, timed.num_steps
        recs, wall = run_offline(engine, prompts, w.output_len, arrival_offsets(w))
        after = timed.inner.execute_stats()
    finally:
        engine.shutdown()
    steps = timed.num_steps - s_before
    worker_s = after["execute_time_s"] - before["execute_time_s"]
    assert after["num_steps"] - before["num_steps"] == steps, (before, after, steps)
    res = summarize(recs, wall)
    res.update(executor=executor, steps=steps, executor_time_s=timed.time_s - t_before, worker_time_s=worker_s,
               overhead_ms_per_step=1e3 * (timed.time_s - t_before - worker_s) / max(steps, 1),
               bytes_per_step=timed.bytes_all / max(steps, 1),
               decode_bytes_per_step=timed.decode_bytes / max(timed.decode_steps, 1),
               decode_bytes_per_req=timed.decode_bytes / max(timed.decode_reqs, 1),
               decode_reqs_per_step=timed.decode_reqs / max(timed.decode_steps, 1))
    return res


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None, help="HF directory or .gguf (default: SmolLM2-135M-Instruct)")
    p.add_argument("--executors", default=",".join(executor_names()),
                   help=f"comma list of {', '.join(executor_names())} (default: all)")
    p.add_argument("--tensor-parallel-size", type=int, default=None,
                   help="ranks for tp (default: the smallest > 1 dividing the model's KV heads; 3 for SmolLM2)")
    p.add_argument("--workload", default="W2")
    p.add_argument("--num-requests", type=int, default=None, help="override the workload's")
    p.add_argument("--output-len", type=int, default=None, help="override the workload's")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="auto")
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=1024)
    p.add_argument("--kv-cache-memory", default="1GiB")
    p.add_argument("--json", default=None, help="write the results to this file")


def print_table(rows: list[dict]) -> None:
    print(f"{'executor':<10} {'out tok/s':>10} {'steps':>6} {'step ms':>8} {'worker ms':>10} "
          f"{'IPC ms/step':>12} {'bytes/step':>11} {'decode B/step':>14} {'decode B/req':>13}")
    for r in rows:
        n = max(r["steps"], 1)
        print(f"{r['executor']:<10} {r['output_tok_s']:10.1f} {r['steps']:6d} {1e3 * r['executor_time_s'] / n:8.2f} "
              f"{1e3 * r['worker_time_s'] / n:10.2f} {r['overhead_ms_per_step']:12.3f} {r['bytes_per_step']:11.0f} "
              f"{r['decode_bytes_per_step']:14.0f} {r['decode_bytes_per_req']:13.1f}")
    base = next((r for r in rows if r["executor"] == "uniproc"), None)
    if base is not None:
        for r in rows:
            if r is not base:
                print(f"{r['executor']}: {r['output_tok_s'] / base['output_tok_s']:.2f}x uniproc output tok/s; "
                      f"IPC overhead {r['overhead_ms_per_step'] - base['overhead_ms_per_step']:+.3f} ms/step "
                      f"over uniproc's")


def main(a) -> int:
    import os

    from llmsvc.config import ModelConfig
    from llmsvc.models.resolve import resolve_model_config
    from transformers import AutoTokenizer

    names = [n.strip() for n in a.executors.split(",") if n.strip()]
    bad = [n for n in names if n not in executor_names()]
    if bad:
        print(f"unknown executor(s) {bad}", file=sys.stderr)
        return 2
    try:
        w = get_workload(a.workload)
    except ValueError as e:
        print(f"llmsvc bench: {e}", file=sys.stderr)
        return 2
    mc = resolve_model_config(ModelConfig(model=a.model))
    a.model = mc.model_dir
    if a.tensor_parallel_size is None:
        kv_heads = getattr(mc.hf_config, "num_key_value_heads", None) or mc.hf_config.num_attention_heads
        a.tensor_parallel_size = next(d for d in range(2, kv_heads + 1) if kv_heads % d == 0) if kv_heads > 1 else 1
    over = {k: getattr(a, k) for k in ("num_requests", "output_len") if getattr(a, k, None) is not None}
    w = dataclasses.replace(w, **over)
    prompts = build_prompts(w, ordinary_vocab(AutoTokenizer.from_pretrained(mc.model_dir)))
    print(f"== {w.name}: {w.num_requests} requests x {w.input_len} in / {w.output_len} out, offline engine, "
          f"{os.cpu_count()} CPU(s); executors: {', '.join(names)} (tp={a.tensor_parallel_size})", flush=True)
    rows = []
    for name in names:
        rows.append(run_one(a, name, w, prompts))
        r = rows[-1]
        print(f"  {name}: {r['output_tok_s']:.1f} out tok/s, {r['steps']} steps, "
              f"IPC overhead {r['overhead_ms_per_step']:.3f} ms/step", flush=True)
    print()
    print_table(rows)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"workload": dataclasses.asdict(w), "results": rows}, f, indent=2, default=str)
    return 0


def main_from_bench(a) -> int:
    """`llmsvc bench --executors ...`: the bench's flags mapped onto this module's main."""
    ns = argparse.Namespace(model=a.model, executors=a.executors, workload=(a.workload or ["W2"])[0],
                            num_requests=a.num_requests, output_len=a.output_len,
                            tensor_parallel_size=a.tensor_parallel_size if a.tensor_parallel_size > 1 else None,
                            dtype=a.dtype, device="auto", max_num_seqs=a.max_num_seqs or 128,
                            max_num_batched_tokens=a.max_num_batched_tokens or 1024,
                            kv_cache_memory=a.kv_cache_memory or "1GiB", json=a.json)
    return main(ns)



if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m llmsvc.bench.executors", description=__doc__.split("\n")[0])
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))

