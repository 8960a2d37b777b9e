"""Async scheduling A/B on this machine, in one command (runs alternate off/on, order flipped
each repeat, so a change in the machine's load hits both alike):

    .venv/bin/python -m benchmarks.async_scheduling [--workloads W1,W2] [--repeats 3] [--dtype bfloat16] [MODEL]

Per workload and mode: `llmsvc bench --workload W --mode both` (offline in-process engine, then a
gRPC server it starts) without and with --async-scheduling; then, in this process, the offline
run again on an engine whose worker reports the host gap (time from the end of one
execute_model to the start of the next: how long the model waits for its next step) and the
process CPU time per output token. Prints median / min / max over the repeats.
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile


def bench_cli(model: str | None, workload: str, dtype: str, on: bool) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        cmd = [sys.executable, "-m", "llmsvc", "bench", "--workload", workload, "--mode", "both",
               "--dtype", dtype, "--json", f.name] + (["--async-scheduling"] if on else [])
        cmd += [model] if model else []
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        res = json.load(open(f.name))["workloads"][workload]
    return {"offline tok/s": res["offline"]["output_tok_s"], "gRPC tok/s": res["serve"]["output_tok_s"]}


def host_gap(model: str | None, workload: str, dtype: str, on: bool) -> dict:
    from llmsvc.bench.runners import run_offline
    from llmsvc.bench.workloads import arrival_offsets, build_prompts, get_workload, ordinary_vocab
    from llmsvc.config import EngineConfig
    from llmsvc.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_config(EngineConfig.from_options(model=model, dtype=dtype, async_scheduling=on,
                                                             log_stats_interval_s=0.0))
    try:
        w = get_workload(workload)
        prompts = build_prompts(w, ordinary_vocab(engine.tokenizer))
        ex = engine.core.executor
        before, cpu0 = ex.execute_stats(), resource.getrusage(resource.RUSAGE_SELF)
        recs, wall = run_offline(engine, prompts, w.output_len, arrival_offsets(w))
        after, cpu1 = ex.execute_stats(), resource.getrusage(resource.RUSAGE_SELF)
    finally:
        engine.shutdown()
    steps = after["num_steps"] - before["num_steps"]
    n_out = sum(len(r.token_times) for r in recs)
    cpu = (cpu1.ru_utime + cpu1.ru_stime) - (cpu0.ru_utime + cpu0.ru_stime)
    return {"host gap ms/step": 1e3 * (after["host_gap_s"] - before["host_gap_s"]) / max(steps - 1, 1),
            "host gap median ms": 1e3 * after["host_gap_median_s"],
            "worker ms/step": 1e3 * (after["execute_time_s"] - before["execute_time_s"]) / max(steps, 1),
            "CPU ms/out tok": 1e3 * cpu / max(n_out, 1), "in-process tok/s": n_out / wall}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", help="HF directory or .gguf (default: SmolLM2-135M-Instruct)")
    p.add_argument("--workloads", default="W1,W2")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--no-cli", action="store_true", help="only the in-process host-gap runs")
    a = p.parse_args(argv)
    for workload in a.workloads.split(","):
        runs = {False: [], True: []}
        for r in range(a.repeats):
            for on in ((False, True) if r % 2 == 0 else (True, False)):
                row = {} if a.no_cli else bench_cli(a.model, workload, a.dtype, on)
                row.update(host_gap(a.model, workload, a.dtype, on))
                runs[on].append(row)
                print(f"{workload} repeat {r} async={on}: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items()),
                      flush=True)
        print(f"\n== {workload} {a.dtype}, {a.repeats} repeats: median (min - max)")
        for key in runs[False][0]:
            cells = []
            for on in (False, True):
                vals = [row[key] for row in runs[on]]
                cells.append(f"{statistics.median(vals):9.2f} ({min(vals):.2f} - {max(vals):.2f})")
            print(f"  {key:<20} sync {cells[0]}   async {cells[1]}")


if __name__ == "__main__":
    main()
