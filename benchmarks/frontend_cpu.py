"""CPU time of each process of a gRPC benchmark run, per 1000 output tokens (Linux /proc).

Starts `llmsvc serve` (engine-core process by default), streams a packaged workload from this
process exactly as `llmsvc bench --mode serve` does, and reads the CPU time (user + system) each
process and each of its threads spent during the run: the engine-core process, the server front
end (event loop = its main thread, the engine thread, gRPC's threads) and this client. On a
loaded machine CPU-seconds move far less than wall times, which is why they are the measure.

    .venv/bin/python -m benchmarks.frontend_cpu [MODEL] --workload W1 --dtype bfloat16 [--repeat 3] \
        [-- SERVE_FLAGS]
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict

_TICK = os.sysconf("SC_CLK_TCK")


def _stat_cpu(path: str) -> float:
    """utime + stime (seconds) from a /proc stat file; the comm field may hold spaces."""
    with open(path) as f:
        rest = f.read().rsplit(")", 1)[1].split()
    return (int(rest[11]) + int(rest[12])) / _TICK


def _comm(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return "?"


_GRPC_THREADS = ("grpc", "event_engine", "default-executo", "resolver", "lifeguard")


def _thread_group(pid: int, tid: int, comm: str) -> str:
    if tid == pid:
        return "main thread"
    if comm.startswith(_GRPC_THREADS):
        return "grpc threads"
    if comm.startswith("ZMQbg"):
        return "zmq threads"
    return comm if comm.startswith("llmsvc") else "other threads"


def snapshot(pid: int) -> dict:
    """{"total": process CPU s (dead threads included), groups: live threads' CPU s by group}."""
    out: dict = defaultdict(float)
    out["total"] = _stat_cpu(f"/proc/{pid}/stat")
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            cpu = _stat_cpu(f"/proc/{pid}/task/{tid}/stat")
        except OSError:  # ended meanwhile
            continue
        out[_thread_group(pid, int(tid), _comm(f"/proc/{pid}/task/{tid}/comm"))] += cpu
    return out


def children(pid: int) -> list[int]:
    kids = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                kids += [int(x) for x in f.read().split()]
        except OSError:
            pass
    return kids


def _diff(after: dict, before: dict) -> dict:
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def _py_spy(out_dir: str, name: str, pid: int) -> subprocess.Popen:
    """py-spy (if installed) sampling `pid` into out_dir/NAME.txt as collapsed stacks."""
    os.makedirs(out_dir, exist_ok=True)
    out = os.path.join(out_dir, name.replace(" ", "_") + ".txt")
    exe = os.path.join(os.path.dirname(sys.executable), "py-spy")
    return subprocess.Popen([exe, "record", "--pid", str(pid), "--format", "raw", "--rate", "250",
                             "--threads", "--nonblocking", "-o", out], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


def run_once(a, prompts, output_len: int) -> dict:
    from llmsvc.bench.runners import run_serving
    from llmsvc.bench.server_proc import free_port, stop_server, wait_serving

    port = free_port()
    cmd = [sys.executable, "-m", "llmsvc", "serve", *([a.model] if a.model else []), "--dtype", a.dtype,
           "--engine-core", a.engine_core, "--host", "127.0.0.1", "--port", str(port), *a.serve_args]
    server = subprocess.Popen(cmd, env=dict(os.environ), stderr=subprocess.DEVNULL)
    target = f"127.0.0.1:{port}"
    try:
        wait_serving(target, 900.0, server)
        procs = {"server front end": server.pid}
        for kid in children(server.pid):
            if _comm(f"/proc/{kid}/comm").startswith("llmsvc-core"):
                procs["engine core"] = kid
                for i, worker in enumerate(children(kid)):  # multiproc / tp executors' workers
                    procs[f"model worker {i}"] = worker
        procs["bench client"] = os.getpid()
        spies = [_py_spy(a.py_spy, name, pid) for name, pid in procs.items()
                 if a.py_spy and name != "engine core"]
        before = {name: snapshot(pid) for name, pid in procs.items()}
        recs, wall = run_serving(target, prompts, output_len, [0.0] * len(prompts))
        after = {name: snapshot(pid) for name, pid in procs.items()}
        for spy in spies:
            spy.send_signal(signal.SIGINT)
            spy.wait(30)
    finally:
        stop_server(server, 30)
    tokens = sum(len(r.token_times) for r in recs)
    return {"wall_s": wall, "tokens": tokens, "tok_s": tokens / wall,
            "cpu": {name: _diff(after[name], before[name]) for name in procs}}


def parse_args(argv=None) -> argparse.Namespace:
    """The flags before `--`; what follows it is `serve_args`, passed to `llmsvc serve`."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", nargs="?", default=None, help="model directory or .gguf (default: SmolLM2-135M-Instruct)")
    p.add_argument("--workload", default="W1")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--engine-core", default="process", choices=["process", "inline"])
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--py-spy", default=None, metavar="DIR",
                   help="also sample the front end and the client with py-spy into DIR (collapsed stacks)")
    argv = sys.argv[1:] if argv is None else list(argv)
    cut = argv.index("--") if "--" in argv else len(argv)  # after --: more `llmsvc serve` flags
    a = p.parse_args(argv[:cut])
    a.serve_args = argv[cut + 1:]
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    from transformers import AutoTokenizer

    from llmsvc.bench.workloads import build_prompts, get_workload, ordinary_vocab
    from llmsvc.config import ModelConfig
    from llmsvc.models.resolve import resolve_model_config

    w = get_workload(a.workload)
    mc = resolve_model_config(ModelConfig(model=a.model))
    prompts = build_prompts(w, ordinary_vocab(AutoTokenizer.from_pretrained(mc.model_dir)))
    for _ in range(a.repeat):
        r = run_once(a, prompts, w.output_len)
        per_k = 1000.0 / max(1, r["tokens"])
        print(f"{a.workload} {a.dtype}: {r['tok_s']:.0f} out tok/s over gRPC ({r['tokens']} tokens, "
              f"{r['wall_s']:.1f} s); CPU ms per 1000 output tokens:")
        for name, groups in r["cpu"].items():
            rest = ", ".join(f"{g} {1000 * v * per_k:.0f}" for g, v in sorted(groups.items())
                             if g != "total")
            print(f"  {name:<17} {1000 * groups['total'] * per_k:7.0f}   ({rest})")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
