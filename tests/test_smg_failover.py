"""Replicas leaving a fleet behind the real SMG gateway while clients keep sending requests
through it (bounded load, loopback only):

- a rolling restart (SIGTERM one replica, wait until it has drained and exited 0, start it again
  on its port, then the other): no client request fails. On SIGTERM a replica reports unhealthy
  at once (grpc.health.v1 and VllmEngine/HealthCheck), ends its KV-event streams (the gateway's
  signal to route elsewhere), refuses new work with UNAVAILABLE (the gateway retries it on the
  other replica) and finishes what it runs;
- a replica SIGKILLed: only requests it was running may fail; every request sent after it died
  succeeds on the other one.
"""
from __future__ import annotations

import signal
import threading
import time

import pytest

from llmsvc.server.vllm_engine.proto import vllm_engine_pb2 as vpb
from llmsvc.v1 import llmsvc_pb2 as v1
from llmsvc.v1 import llmsvc_pb2_grpc as v1_grpc
from tests.server_harness import make_tiny_served_model_dir
from tests.smg_utils import smg_fleet

pytestmark = pytest.mark.slow  # each starts its own fleet and waits for replicas to leave and return


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_served_model_dir(tmp_path_factory.mktemp("smg"), max_position_embeddings=4096)


class Load:
    """`clients` threads sending chat completions through the gateway one after another until
    stopped; every request is recorded as (sent, finished, ok, what went wrong)."""

    def __init__(self, fleet, clients: int = 3, max_tokens: int = 24) -> None:
        self.fleet, self.max_tokens = fleet, max_tokens
        self.results: list[tuple[float, float, bool, str]] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(clients)]

    def _loop(self, i: int) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            body = {"model": self.fleet.model, "max_tokens": self.max_tokens, "temperature": 0, "ignore_eos": True,
                    "messages": [{"role": "user", "content": f"client {i} request {n}"}]}
            t0 = time.monotonic()
            try:
                status, got = self.fleet.post("/v1/chat/completions", body, timeout=120)
                ok = status == 200 and got["usage"]["completion_tokens"] == self.max_tokens
                why = "" if ok else f"HTTP {status}: {str(got)[:300]}"
            except OSError as e:
                ok, why = False, f"{type(e).__name__}: {e}"
            self.results.append((t0, time.monotonic(), ok, why))

    def __enter__(self) -> "Load":
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(180)

    def wait_for(self, n: int, timeout: float = 120.0) -> None:
        """Until n more requests have finished (the load is really flowing)."""
        target, deadline = len(self.results) + n, time.monotonic() + timeout
        while len(self.results) < target:
            assert time.monotonic() < deadline, "the load stalled"
            time.sleep(0.1)

    def failures(self) -> list[tuple[float, float, bool, str]]:
        return [r for r in self.results if not r[2]]


def generated_ok(replica) -> float:
    key = 'llmsvc_grpc_requests_total{code="OK",method="Generate",service="vllm.grpc.engine.VllmEngine"}'
    return replica.metrics().get(key, 0.0)


def wait_running(replica, timeout: float = 60.0) -> None:
    """Until the replica runs a request (so a stop signal now lands on work in flight)."""
    stub, deadline = v1_grpc.LlmServiceStub(replica.channel), time.monotonic() + timeout
    while stub.GetServerInfo(v1.GetServerInfoRequest(), timeout=5).num_running == 0:
        assert time.monotonic() < deadline, "the gateway sent the replica nothing"
        time.sleep(0.02)


def wait_workers(fleet, n: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while fleet.gateway.workers_healthy() != n:
        assert time.monotonic() < deadline, f"the gateway never saw {n} healthy workers\n" + fleet.logs()
        time.sleep(0.2)


def test_rolling_restart_under_load_fails_no_request(model_dir):
    with smg_fleet(model_dir, replicas=2, serve_args=("--shutdown-grace", "60")) as fleet, \
            Load(fleet, max_tokens=150) as load:
        load.wait_for(6)
        for r in fleet.replicas:
            wait_running(r)
            r.proc.signal_group(signal.SIGTERM)  # as a supervisor stops a container: every process
            deadline = time.monotonic() + 10
            while r.serving() or r.engine.HealthCheck(vpb.HealthCheckRequest(), timeout=2).healthy:
                assert time.monotonic() < deadline, "still healthy after SIGTERM"
                time.sleep(0.05)
            assert r.proc.proc.wait(90) == 0, r.proc.tail()  # drained what it ran, exited cleanly
            load.wait_for(3)  # the other replica carries the load alone
            r.start().wait_serving()
            wait_workers(fleet, 2)
            before = generated_ok(r)
            deadline = time.monotonic() + 60
            while generated_ok(r) == before:  # traffic comes back to the restarted replica
                assert time.monotonic() < deadline, "the gateway never routed to the restarted replica"
                time.sleep(0.2)
        load.wait_for(3)
    assert load.failures() == [], load.failures()[:5]
    assert len(load.results) >= 12


def test_sigkilled_replica_fails_only_its_in_flight_requests(model_dir):
    with smg_fleet(model_dir, replicas=2) as fleet, Load(fleet, clients=4, max_tokens=150) as load:
        load.wait_for(6)
        victim = fleet.replicas[0]
        wait_running(victim)
        victim.proc.signal_group(signal.SIGKILL)  # the replica's whole process tree dies at once
        killed_at = time.monotonic()
        victim.proc.proc.wait(10)
        load.wait_for(12)
    failed = load.failures()
    assert all(sent < killed_at for sent, _, _, _ in failed), f"a request sent after the kill failed: {failed}"
    assert len(failed) <= 4  # at most one per client: those in flight at the kill
    assert sum(1 for sent, _, ok, _ in load.results if sent > killed_at and ok) >= 12


def test_a_draining_replica_refuses_and_the_gateway_retries_elsewhere(model_dir):
    """round_robin sends every other request to the replica that is draining (it still runs a
    long request): each is refused with UNAVAILABLE there, and SMG retries it on the other."""
    with smg_fleet(model_dir, replicas=2, policy="round_robin", serve_args=("--shutdown-grace", "60")) as fleet:
        draining, other = fleet.replicas
        long = draining.engine.Generate(vpb.GenerateRequest(
            request_id="long", tokenized=vpb.TokenizedInput(input_ids=[257, 104]), stream=True,
            sampling_params=vpb.SamplingParams(temperature=0.0, max_tokens=900, ignore_eos=True)), timeout=120)
        assert next(long).HasField("chunk")
        draining.proc.proc.send_signal(signal.SIGTERM)
        while draining.serving():
            time.sleep(0.02)
        for i in range(6):
            status, got = fleet.post("/v1/chat/completions", {
                "model": fleet.model, "max_tokens": 4, "messages": [{"role": "user", "content": f"question {i}"}]})
            assert status == 200, got
        refused = 'llmsvc_grpc_requests_total{code="UNAVAILABLE",method="Generate",service="vllm.grpc.engine.VllmEngine"}'
        assert draining.metrics().get(refused, 0) >= 1  # the gateway did try it
        assert generated_ok(other) == 6 and generated_ok(draining) == 0
        long.cancel()
