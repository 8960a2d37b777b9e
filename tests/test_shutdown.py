"""Graceful shutdown of a REAL `python -m llmsvc serve` process (tiny random Llama on the CPU):
a signal mid-stream drains (NOT_SERVING, new requests UNAVAILABLE), lets the stream finish
(or aborts it when --shutdown-grace runs out), exits 0 and leaves no child process behind."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmsvc.v1 import llmsvc_pb2 as pb
from llmsvc.v1 import llmsvc_pb2_grpc as pb_grpc
from llmsvc.core.proc_tree import kill_all
from tests.executor_procs import alive, descendants, worker_pids
from tests.server_harness import make_tiny_served_model_dir

SERVICE = "llmsvc.v1.LlmService"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_served_model_dir(tmp_path_factory.mktemp("tiny"), max_position_embeddings=4096)


class ServeProcess:
    """`python -m llmsvc serve` on 127.0.0.1, any free port (read from its "listening on" log line)."""

    def __init__(self, model_dir: str, *extra: str) -> None:
        cmd = [sys.executable, "-m", "llmsvc", "serve", model_dir, "--host", "127.0.0.1", "--port", "0",
               "--device", "cpu", "--max-model-len", "4096", "--kv-cache-memory", "8MiB", *extra]
        env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
        env.pop("LLMSVC_AUTH_TOKENS", None)
        env.pop("LLMSVC_ADMIN_TOKENS", None)
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True)
        self.lines: list[str] = []
        self._port: int | None = None
        self._got_port = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        if not self._got_port.wait(120) or self._port is None:
            self.kill()
            raise AssertionError("server did not start:\n" + "".join(self.lines[-40:]))
        self.address = f"127.0.0.1:{self._port}"
        self.channel = grpc.insecure_channel(self.address)
        self.stub = pb_grpc.LlmServiceStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)
            m = re.search(r"listening on 127\.0\.0\.1:(\d+)", line)
            if m and self._port is None:
                self._port = int(m.group(1))
                self._got_port.set()
        self._got_port.set()

    def status(self, service: str = SERVICE):
        return self.health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status

    def wait_serving(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while self.status() != health_pb2.HealthCheckResponse.SERVING:
            assert self.proc.poll() is None, "server exited:\n" + "".join(self.lines[-40:])
            assert time.monotonic() < deadline, "server never became SERVING"
            time.sleep(0.1)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def close(self) -> None:
        self.channel.close()
        self.kill()


def _stream(max_tokens: int):
    return pb.GenerateRequest(text="drain me", stream=True, sampling=pb.SamplingParams(temperature=0.0),
                              stopping=pb.StoppingCriteria(max_tokens=max_tokens, ignore_eos=True))


def _signal_mid_stream(srv: ServeProcess, sig: int, max_tokens: int):
    """Open a stream, send `sig` after its first message; returns (messages, children before the signal)."""
    call = srv.stub.Generate(_stream(max_tokens), timeout=120)
    msgs = [next(call)]
    children = set(descendants(srv.proc.pid))
    srv.proc.send_signal(sig)
    deadline = time.monotonic() + 10
    while srv.status() != health_pb2.HealthCheckResponse.NOT_SERVING:  # draining, still answering
        assert time.monotonic() < deadline, "health never turned NOT_SERVING"
        time.sleep(0.01)
    with pytest.raises(grpc.RpcError) as ei:
        list(srv.stub.Generate(_stream(2), timeout=10))
    assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
    msgs.extend(call)  # the in-flight stream still ends normally (status OK)
    return msgs, children


@pytest.mark.parametrize("executor", ["uniproc", "multiproc"])
def test_sigterm_mid_stream_finishes_stream_exits_0_no_children(tiny_dir, executor):
    srv = ServeProcess(tiny_dir, "--executor", executor, "--shutdown-grace", "60")
    try:
        srv.wait_serving()
        msgs, children = _signal_mid_stream(srv, signal.SIGTERM, max_tokens=120)
        assert msgs[-1].finish.reason == pb.FinishInfo.REASON_LENGTH
        assert sum(len(m.token_ids) for m in msgs) == 120 and msgs[-1].num_output_tokens == 120
        assert srv.proc.wait(60) == 0, "".join(srv.lines[-40:])
        if executor == "multiproc":
            assert children, "the multiproc executor should have started a worker process"
        time.sleep(0.2)
        assert not [p for p in children if alive(p)], "child processes outlived the server"
        log = "".join(srv.lines)
        assert "draining" in log and "stopped" in log
    finally:
        srv.close()


def test_sigint_past_grace_aborts_in_flight_and_exits_0_json_logs(tiny_dir):
    srv = ServeProcess(tiny_dir, "--shutdown-grace", "0.5", "--log-format", "json")
    try:
        srv.wait_serving()
        msgs, _ = _signal_mid_stream(srv, signal.SIGINT, max_tokens=4000)  # far longer than the grace
        assert msgs[-1].finish.reason == pb.FinishInfo.REASON_ABORTED  # cut off at the grace period
        assert msgs[-1].num_output_tokens < 4000
        assert srv.proc.wait(60) == 0, "".join(srv.lines[-40:])
        records = [json.loads(line) for line in srv.lines if line.startswith("{")]
        msgs_logged = [r["msg"] for r in records]
        for phrase in ("listening on", "ready", "draining", "stopped"):
            assert any(phrase in m for m in msgs_logged), phrase
        assert all({"ts", "level", "logger", "msg"} <= set(r) for r in records)
        finished = [r for r in records if "finished" in r["msg"] and r["logger"] == "llmsvc.server.servicer"]
        assert finished and finished[0]["request_id"] and finished[0]["request_id"] in finished[0]["msg"]
    finally:
        srv.close()


def test_second_sigterm_cuts_the_grace_period_short(tiny_dir):
    srv = ServeProcess(tiny_dir, "--executor", "uniproc", "--shutdown-grace", "600")
    try:
        srv.wait_serving()
        call = srv.stub.Generate(_stream(4000), timeout=120)  # longer than this test waits
        msgs = [next(call)]
        srv.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while srv.status() != health_pb2.HealthCheckResponse.NOT_SERVING:
            assert time.monotonic() < deadline, "health never turned NOT_SERVING"
            time.sleep(0.01)
        msgs.append(next(call))  # still streaming: the first signal only drains
        _sigterm_cuts_the_grace(srv, call, msgs, "second stop signal")  # not the 600 s grace
    finally:
        srv.close()


def _sigterm_cuts_the_grace(srv: ServeProcess, call, msgs: list, logged: str) -> None:
    """SIGTERM now: the 4000-token stream in flight ends aborted and the server exits 0 well
    within a minute, logging `logged`."""
    t0 = time.monotonic()
    srv.proc.send_signal(signal.SIGTERM)
    msgs.extend(call)
    assert msgs[-1].finish.reason == pb.FinishInfo.REASON_ABORTED
    assert msgs[-1].num_output_tokens < 4000
    assert srv.proc.wait(60) == 0, "".join(srv.lines[-40:])
    assert time.monotonic() - t0 < 60
    assert logged in "".join(srv.lines)


def _serve_with_admin(tiny_dir, tmp_path, grace: str):
    """A serving server with --shutdown-grace `grace` and admin token "root": (server, admin
    stub, the token's metadata)."""
    tokens = tmp_path / "admin-tokens"
    tokens.write_text("root\n")
    srv = ServeProcess(tiny_dir, "--shutdown-grace", grace, "--admin-token-file", str(tokens))
    try:
        srv.wait_serving()
    except BaseException:
        srv.close()
        raise
    return srv, pb_grpc.AdminServiceStub(srv.channel), (("authorization", "Bearer root"),)


def test_drain_rpc_drains_like_sigterm_and_flush_cache_reaches_the_core(tiny_dir, tmp_path):
    srv, admin, md = _serve_with_admin(tiny_dir, tmp_path, "600")
    try:
        prompt = pb.GenerateRequest(text="a prompt of a few blocks " * 4, stopping=pb.StoppingCriteria(max_tokens=1))
        cached = [list(srv.stub.Generate(prompt, timeout=60))[0].prompt.num_cached_tokens for _ in range(2)]
        assert cached[0] == 0 and cached[1] > 0
        admin.FlushCache(pb.FlushCacheRequest(), metadata=md, timeout=30)  # through the engine-core process
        assert list(srv.stub.Generate(prompt, timeout=60))[0].prompt.num_cached_tokens == 0
        call = srv.stub.Generate(_stream(60), timeout=120)
        msgs = [next(call)]
        resp = admin.Drain(pb.DrainRequest(grace_seconds=60), metadata=md, timeout=10)
        assert resp.num_running + resp.num_waiting == 1 and not resp.already_draining
        assert srv.status() == health_pb2.HealthCheckResponse.NOT_SERVING
        msgs.extend(call)
        assert msgs[-1].finish.reason == pb.FinishInfo.REASON_LENGTH and msgs[-1].num_output_tokens == 60
        assert srv.proc.wait(60) == 0, "".join(srv.lines[-40:])
        assert "Drain RPC" in "".join(srv.lines)
    finally:
        srv.close()


def test_sigterm_during_a_longer_drain_waits_at_most_the_shutdown_grace(tiny_dir, tmp_path):
    """A supervisor sizes its stop timeout to --shutdown-grace; a Drain RPC's longer grace must
    not outlast it once the supervisor signals."""
    srv, admin, md = _serve_with_admin(tiny_dir, tmp_path, "1")
    try:
        call = srv.stub.Generate(_stream(4000), timeout=120)  # longer than this test waits
        msgs = [next(call)]
        admin.Drain(pb.DrainRequest(grace_seconds=600), metadata=md, timeout=10)
        msgs.append(next(call))  # still streaming: the drain waits for it
        _sigterm_cuts_the_grace(srv, call, msgs, "stop signal while draining")  # not the Drain's 600 s
    finally:
        srv.close()


def test_sigterm_with_a_stopped_worker_leaves_no_process_behind(tiny_dir):
    """A worker that cannot run (SIGSTOP: hung) blocks the engine core in its step; the server
    still ends, and the core's processes end with it (a stopped worker cannot follow its
    death pipe: it is killed)."""
    srv = ServeProcess(tiny_dir, "--executor", "multiproc", "--shutdown-grace", "0.5")
    tree: list[int] = []
    try:
        srv.wait_serving()
        call = srv.stub.Generate(_stream(4000), timeout=120)
        next(call)
        tree = descendants(srv.proc.pid)
        (worker,) = worker_pids(srv.proc.pid)
        os.kill(worker, signal.SIGSTOP)
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(90) is not None
        time.sleep(0.5)
        assert not [p for p in tree if alive(p)], "processes outlived the server"
        assert "engine core did not stop" in "".join(srv.lines)
    finally:
        srv.close()
        kill_all(tree)  # whatever a failure left behind

