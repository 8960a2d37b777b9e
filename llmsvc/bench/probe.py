"""Latency of small unary RPCs (GetServerInfo, Tokenize) while a workload streams: how long the
server's event loop makes a cheap call wait when it is busy. Runs on its own thread and channel
so the benchmark client's own event loop does not add to what it measures.

Five rounds a second, as a dashboard or load balancer polls: each call wakes the server's event
loop and gRPC's poller thread on the cores the model uses, so at 20 rounds a second the probe
alone cost W1 over gRPC 5-10% of its throughput on a 2-core box."""
from __future__ import annotations

import threading
import time

from llmsvc.bench.metrics import fmt_ms, percentiles

RPCS = ("GetServerInfo", "Tokenize")


class RpcProbe:
    """`with RpcProbe(target): ...` calls each RPC every `interval_s` until the block ends."""

    def __init__(self, target: str, interval_s: float = 0.2) -> None:
        self.target, self.interval_s = target, interval_s
        self.latencies: dict[str, list[float]] = {name: [] for name in RPCS}
        self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rpc-probe", daemon=True)

    def __enter__(self) -> "RpcProbe":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        import grpc

        from llmsvc.v1 import llmsvc_pb2 as pb
        from llmsvc.v1 import llmsvc_pb2_grpc as pb_grpc

        calls = {"GetServerInfo": lambda s: s.GetServerInfo(pb.GetServerInfoRequest(), timeout=10),
                 "Tokenize": lambda s: s.Tokenize(pb.TokenizeRequest(text="How long does a small call wait?"),
                                                  timeout=10)}
        with grpc.insecure_channel(self.target) as ch:
            stub = pb_grpc.LlmServiceStub(ch)
            while True:  # at least one round, however short the workload
                for name, call in calls.items():
                    t0 = time.perf_counter()
                    try:
                        call(stub)
                    except grpc.RpcError:
                        self.errors += 1
                        continue
                    self.latencies[name].append(time.perf_counter() - t0)
                if self._stop.wait(self.interval_s):
                    return

    def summary(self) -> dict:
        """{rpc: {"n", "mean", "p50", "p90", "p99" (seconds)}} plus "errors"."""
        return merged_summary([self])


def merged_summary(probes: list[RpcProbe]) -> dict:
    """RpcProbe.summary over the calls of several probes (the runs of a `--repeat`)."""
    out: dict = {"errors": sum(p.errors for p in probes)}
    for name in RPCS:
        xs = [x for p in probes for x in p.latencies[name]]
        out[name] = {"n": len(xs), **percentiles(xs)}
    return out


def print_latency(summary: dict, runs: str = "") -> None:
    """One line per RPC of a (merged) summary; `runs`: appended inside the parenthesis."""
    for name in RPCS:
        print(f"  {name + ' alongside':<28} {fmt_ms(summary[name])} ({summary[name]['n']} calls{runs}"
              + (f", {summary['errors']} failed)" if summary["errors"] else ")"))
