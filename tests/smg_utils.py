"""The SMG gateway in front of real `llmsvc serve` replicas, all on loopback, for tests.

    with smg_fleet(model_dir, replicas=2) as fleet:
        fleet.post("/v1/chat/completions", {...})       # OpenAI's API, through SMG
        fleet.replicas[0].engine.GetServerInfo(...)     # one replica's vllm.grpc.engine door

Each process runs in a session of its own, so stopping one stops its whole tree (the engine-core
process included); every wait is bounded, and everything started is stopped on the way out,
failures included. SMG reads the tokenizer and chat template from the model directory (which
must hold them: tests/server_harness.make_tiny_served_model_dir writes both) and never reaches
a model hub (HF_HUB_OFFLINE). Replicas get fixed ports, chosen free at start: SMG names its
workers by URL, so a replica restarted on its port is the same worker to it.
"""
from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmsvc.bench.server_proc import free_port
from llmsvc.server.vllm_engine.proto import SERVICE_NAME, vllm_engine_pb2_grpc
from tests.executor_procs import REPO, subprocess_env

SMG = os.path.join(os.path.dirname(sys.executable), "smg")
NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback, whatever *_proxy says
# a replica small enough that two of them and SMG share 2 cores with the rest of the suite
REPLICA_ARGS = ("--device", "cpu", "--max-model-len", "1024", "--kv-cache-memory", "8MiB",
                "--max-num-seqs", "16")
# the gateway's checks as often as it allows (1 s), so a test sees it react in seconds, not minutes
# --shutdown-grace-period-secs: the tests stop SMG with nothing in flight, and with its default
# (180) SMG still took ~5 s to exit on SIGTERM (1 s: ~0.6 s)
SMG_ARGS = ("--health-check-interval-secs", "1", "--health-check-timeout-secs", "2",
            "--worker-startup-check-interval", "1", "--load-monitor-interval", "1", "--log-level", "warn",
            "--shutdown-grace-period-secs", "1")


class Proc:
    """A child in its own session, its stderr (stdout too) kept line by line."""

    def __init__(self, name: str, cmd: list[str], env: dict) -> None:
        self.name = name
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, errors="replace", start_new_session=True)
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    def tail(self, n: int = 30) -> str:
        return f"--- {self.name} (exit {self.proc.poll()}) ---\n" + "".join(self.lines[-n:])

    def alive(self) -> bool:
        return self.proc.poll() is None

    def signal_group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)

    def stop(self, grace: float = 30.0) -> int | None:
        """SIGTERM the session, SIGKILL what is left after `grace` s; the exit code (None: killed)."""
        code = None
        if self.alive():
            self.signal_group(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                code = self.proc.wait(grace)
        self.signal_group(signal.SIGKILL)  # stragglers of an exited leader too
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        return code


class Replica:
    """`python -m llmsvc serve` on 127.0.0.1:port (port chosen here and kept across restarts)."""

    def __init__(self, name: str, model_dir: str, extra: tuple[str, ...] = ()) -> None:
        self.name, self.model_dir, self.extra = name, model_dir, extra
        self.port, self.metrics_port = free_port(), free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.url = f"grpc://{self.address}"
        self.proc: Proc | None = None
        self.channel = grpc.insecure_channel(self.address)
        self.engine = vllm_engine_pb2_grpc.VllmEngineStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    def start(self) -> "Replica":
        cmd = [sys.executable, "-m", "llmsvc", "serve", self.model_dir, "--host", "127.0.0.1",
               "--port", str(self.port), "--metrics-port", str(self.metrics_port), *REPLICA_ARGS, *self.extra]
        self.proc = Proc(self.name, cmd, subprocess_env())
        return self

    def metrics(self) -> dict[str, float]:
        """The replica's Prometheus samples, by name with labels (`name{a="b"}`), summed over
        nothing: one value per line of /metrics."""
        with NO_PROXY.open(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
            text = r.read().decode()
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                out[key] = float(value)
        return out

    def serving(self, service: str = SERVICE_NAME) -> bool:
        try:
            r = self.health.Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
        except grpc.RpcError:
            return False
        return r.status == health_pb2.HealthCheckResponse.SERVING

    def wait_serving(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while not self.serving():
            assert self.proc.alive(), "replica exited during start-up\n" + self.proc.tail()
            assert time.monotonic() < deadline, "replica never SERVING\n" + self.proc.tail()
            time.sleep(0.2)

    def close(self) -> None:
        if self.proc is not None:
            self.proc.stop()
        self.channel.close()


class Gateway:
    """`smg launch` on 127.0.0.1 in front of `worker_urls`, with its Prometheus endpoint."""

    def __init__(self, worker_urls: list[str], model_dir: str | None, policy: str = "cache_aware",
                 extra: tuple[str, ...] = ()) -> None:
        """model_dir None: no --model-path, so SMG takes the tokenizer from the path a worker
        reports (GetModelInfo) or, where that is not a directory here, from the worker itself
        (GetTokenizer), as a gateway on another machine does."""
        self.port, self.metrics_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [SMG, "launch", "--host", "127.0.0.1", "--port", str(self.port), "--worker-urls", *worker_urls,
               "--policy", policy, "--prometheus-host", "127.0.0.1", "--prometheus-port", str(self.metrics_port),
               *(["--model-path", model_dir] if model_dir else []), *SMG_ARGS, *extra]
        self.proc = Proc("smg", cmd, {**os.environ, "HF_HUB_OFFLINE": "1", "NO_COLOR": "1"})

    def get(self, path: str, timeout: float = 10.0) -> tuple[int, dict | str]:
        return _http(self.url + path, None, timeout)

    def post(self, path: str, body: dict, timeout: float = 60.0) -> tuple[int, dict | str]:
        return _http(self.url + path, body, timeout)

    def workers_healthy(self) -> int:
        status, body = self.get("/workers", timeout=5)
        if status != 200 or not isinstance(body, dict):
            return 0
        return sum(1 for w in body.get("workers", []) if w.get("is_healthy"))

    def wait_ready(self, num_workers: int, timeout: float = 90.0) -> None:
        """Until SMG has registered `num_workers` healthy workers, lists a model and has loaded
        its tokenizer (in the background: until then a request is answered 503)."""
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc.alive(), "SMG exited\n" + self.proc.tail()
            with contextlib.suppress(OSError, ValueError, AttributeError):
                models, toks = self.get("/v1/models", timeout=5), self.get("/v1/tokenizers", timeout=5)
                if (self.workers_healthy() >= num_workers and models[0] == 200 and models[1].get("data")
                        and toks[0] == 200 and toks[1].get("tokenizers")):
                    return
            assert time.monotonic() < deadline, f"SMG not ready with {num_workers} workers\n" + self.proc.tail()
            time.sleep(0.3)

    def close(self) -> None:
        self.proc.stop(10.0)


def _http(url: str, body: dict | None, timeout: float) -> tuple[int, dict | str]:
    """(status, parsed JSON or text) of a GET (body None) or JSON POST; HTTP errors included."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with NO_PROXY.open(req, timeout=timeout) as r:
            status, raw = r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read().decode(errors="replace")
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw


def sse_events(resp):
    """The JSON objects of a server-sent event stream (an http.client response), up to [DONE]."""
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data:"):
            continue
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


@contextlib.contextmanager
def open_stream(url: str, path: str, body: dict, timeout: float = 60.0):
    """A streamed POST (body["stream"] = True) on its own connection; yields the http.client
    response (its status checked by the caller). Leaving the block closes the connection: a
    client that goes away mid-stream."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.request("POST", path, json.dumps({**body, "stream": True}), {"Content-Type": "application/json"})
        yield conn.getresponse()
    finally:
        conn.close()


class Fleet:
    def __init__(self, gateway: Gateway, replicas: list[Replica]) -> None:
        self.gateway, self.replicas = gateway, replicas
        self.url = gateway.url
        self.get, self.post = gateway.get, gateway.post
        self.model = self.get("/v1/models")[1]["data"][0]["id"]  # the id requests must name

    def stream(self, path: str, body: dict) -> list[dict]:
        """Every event of a streamed request (HTTP 200 asserted)."""
        with open_stream(self.url, path, body) as resp:
            assert resp.status == 200, resp.read()[:500]
            return list(sse_events(resp))

    def logs(self) -> str:
        return "\n".join(p.proc.tail() for p in self.replicas if p.proc) + "\n" + self.gateway.proc.tail()


@contextlib.contextmanager
def smg_fleet(model_dir: str, replicas: int = 2, policy: str = "cache_aware",
              serve_args: tuple[str, ...] = (), smg_args: tuple[str, ...] = (), after_load=None):
    """SMG in front of `replicas` fresh `llmsvc serve` processes on `model_dir`; yields a Fleet
    once every replica is SERVING and SMG routes to all of them. Stops everything on exit.
    after_load: called once the replicas serve, before SMG starts; a callable given here also
    means SMG gets no --model-path (Gateway: the tokenizer from the workers)."""
    reps = [Replica(f"replica-{i}", model_dir, serve_args) for i in range(replicas)]
    gateway = None
    try:
        for r in reps:  # all load at once; SMG starts after, so it registers them at its first probe
            r.start()
        for r in reps:
            r.wait_serving()
        if after_load is not None:
            after_load()
        gateway = Gateway([r.url for r in reps], None if after_load else model_dir, policy, smg_args)
        gateway.wait_ready(replicas)
        yield Fleet(gateway, reps)
    finally:
        if gateway is not None:
            gateway.close()
        for r in reps:
            r.close()
