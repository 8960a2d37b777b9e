"""Start `llmsvc serve` as a child process on a free loopback port for a benchmark, and stop it."""
from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time


_LOW_PORT = 10000  # the lowest port free_port picks (below: well-known and registered services)
_handed_out: set[int] = set()
_rng = random.SystemRandom()  # not the global generator, which a caller may have seeded


def _ephemeral_start() -> int:
    """The first port of the kernel's ephemeral range (outgoing connections, binds to port 0)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def port_range() -> tuple[int, int]:
    """[lo, hi) that free_port draws from: $LLMSVC_BENCH_PORTS ("LO-HI": where a firewall opens
    only some ports, or to give processes that start servers at once disjoint ranges, as the
    parallel test workers do), else from _LOW_PORT up to the ephemeral range; (0, 0) where that
    leaves too few (port-0 binds then)."""
    spec = os.environ.get("LLMSVC_BENCH_PORTS", "").strip()
    if not spec:
        hi = _ephemeral_start()
        return (_LOW_PORT, hi) if hi - _LOW_PORT > 1000 else (0, 0)
    try:
        lo, hi = (int(x) for x in spec.split("-"))
    except ValueError:
        lo = hi = -1
    if not 0 < lo < hi <= 65536:
        raise ValueError(f"LLMSVC_BENCH_PORTS={spec!r}: expected LO-HI with 0 < LO < HI <= 65536, e.g. 20000-21000")
    return lo, hi


def free_port() -> int:
    """A loopback TCP port nothing is bound to, for a server about to start. Between this check
    and the server's bind another socket may take the port, so it is drawn at random below the
    kernel's ephemeral range (port_range), where no outgoing connection (nor another bind to
    port 0) lands, and never the same twice in one process: two servers of one fleet once got
    the same port from port-0 binds and the second exited with "Address already in use"."""
    lo, hi = port_range()
    for _ in range(200):
        port = _rng.randrange(lo, hi) if hi else 0
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            port = s.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port
    raise RuntimeError(f"no free loopback port found in {lo}-{hi}" if hi else "no free loopback port found")


def wait_serving(target: str, timeout: float, proc: subprocess.Popen | None = None) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(target) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"server exited with code {proc.returncode} during start-up")
            try:
                r = stub.Check(health_pb2.HealthCheckRequest(service="llmsvc.v1.LlmService"), timeout=2)
                if r.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.5)
    raise TimeoutError(f"{target} not SERVING after {timeout:.0f}s")


def flush_server_cache(target: str, timeout: float = 30.0) -> bool:
    """Empty a running server's prefix cache before a measured run (as the bench's --openai runs
    do through the gateway), so that --server runs of the same prompts start cold. Through vLLM's
    engine protocol, which `llmsvc serve` speaks unless --no-vllm-engine and whose FlushCache
    needs no admin token. False when the server has no such method or did not flush."""
    import grpc

    from llmsvc.server.vllm_engine.proto import common_pb2, vllm_engine_pb2_grpc

    with grpc.insecure_channel(target) as ch:
        try:
            return vllm_engine_pb2_grpc.VllmEngineStub(ch).FlushCache(
                common_pb2.FlushCacheRequest(timeout_s=timeout), timeout=timeout + 5).success
        except grpc.RpcError:
            return False


@contextlib.contextmanager
def running_server(serve_args: list[str], timeout: float = 900.0):
    """Yield "127.0.0.1:PORT" of a fresh `llmsvc serve` child; SIGTERM (then SIGKILL) it afterwards."""
    port = free_port()
    cmd = [sys.executable, "-m", "llmsvc", "serve", *serve_args, "--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen(cmd, env=dict(os.environ))
    target = f"127.0.0.1:{port}"
    try:
        wait_serving(target, timeout, proc)
        yield target
    finally:
        stop_server(proc, 30)


def stop_server(proc: subprocess.Popen, grace: float) -> None:
    """SIGTERM (the server drains), then SIGKILL if it is still up after `grace` seconds."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
