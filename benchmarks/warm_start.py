"""Warm start of `llmsvc serve`: seconds from the command to SERVING, and where they go.

Starts the server (caches warm: the GGUF conversion and the CPU kernels are built on the first
run, which this does before timing), polls the standard health service every 50 ms for
`llmsvc.v1.LlmService`, and stops it once it answers SERVING. Each run also prints when the
server's own log lines appeared (listening, model loaded, KV cache, core ready, ready), so the
start-up's phases show beside the total. `--checkout DIR` times another checkout of llmsvc
with the same interpreter (as `benchmarks.ab_build` does for kernels); runs then alternate.

    .venv/bin/python -m benchmarks.warm_start [--repeat 5] [--checkout DIR] [-- serve flags]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import threading
import time

from llmsvc.bench.server_proc import free_port, stop_server

# log messages that mark a phase: (label, text in the line)
PHASES = (("listening", "listening on"), ("kernels", "CPU kernels:"), ("model loaded", "model_runner: loaded"),
          ("KV cache", "KV cache:"), ("core ready", "engine core ready"), ("ready", "ready: serving"))


def server_env(cwd: str) -> dict[str, str]:
    """This process' environment with the checkout first on PYTHONPATH, and what PYTHONPATH held
    already (packages installed beside the interpreter's) after it."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (cwd, os.environ.get("PYTHONPATH")) if p)}


def start_once(cwd: str, serve_args: list[str], timeout: float = 300.0) -> tuple[float, dict[str, float]]:
    """(seconds to SERVING, {phase: seconds}) of one `llmsvc serve` started from `cwd`."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    port = free_port()
    env = server_env(cwd)
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "llmsvc", "serve", *serve_args, "--port", str(port)],
                            cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    phases: dict[str, float] = {}
    log: list[str] = []

    def read() -> None:
        for line in proc.stdout:
            log.append(line)
            for label, text in PHASES:
                if text in line and label not in phases:
                    phases[label] = time.monotonic() - t0

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    serving = None
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            request = health_pb2.HealthCheckRequest(service="llmsvc.v1.LlmService")
            while time.monotonic() - t0 < timeout and proc.poll() is None:
                try:
                    if stub.Check(request, timeout=1).status == health_pb2.HealthCheckResponse.SERVING:
                        serving = time.monotonic() - t0
                        break
                except grpc.RpcError:
                    pass
                time.sleep(0.05)
    finally:
        stop_server(proc, 30)
        reader.join(5)
    if serving is None:
        raise RuntimeError("server did not reach SERVING:\n" + "".join(log[-20:]))
    return serving, phases


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--checkout", default=None, help="another llmsvc checkout to time against this one")
    p.add_argument("serve_args", nargs="*", help="flags for `llmsvc serve` (after --)")
    a = p.parse_args(argv)
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    builds = [("this", here)] + ([("checkout", os.path.abspath(a.checkout))] if a.checkout else [])
    for _, cwd in builds:  # conversion, kernel build, page cache: outside the timing
        start_once(cwd, a.serve_args)
    times: dict[str, list[float]] = {name: [] for name, _ in builds}
    for i in range(a.repeat):
        for name, cwd in (builds if i % 2 == 0 else builds[::-1]):
            total, phases = start_once(cwd, a.serve_args)
            times[name].append(total)
            marks = "  ".join(f"{k} +{v:.2f}" for k, v in sorted(phases.items(), key=lambda kv: kv[1]))
            print(f"{name:8s} run {i + 1}: SERVING after {total:.2f} s   ({marks})", flush=True)
    for name, ts in times.items():
        print(f"{name:8s} to SERVING: median {statistics.median(ts):.2f} s (min {min(ts):.2f}, "
              f"max {max(ts):.2f}, {len(ts)} runs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
