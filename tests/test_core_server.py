"""A REAL `python -m llmsvc serve` with the engine core in its own process (the default): a stream
cancelled or past its deadline on an idle server leaves GetServerInfo showing nothing running and
every block free; bad input (among it a constraint that does not compile, sent twice) fails alone
while other streams go on; a SIGKILLed engine core ends every stream UNAVAILABLE within 2 s, turns
health NOT_SERVING and makes the server exit non-zero with no child left; a SIGKILLed front end
takes the core and its workers with it. (A SIGKILLed worker under --executor multiproc:
tests/test_executors_server.py, which runs this same default layout.)"""
from __future__ import annotations

import glob
import os
import shutil
import signal
import tempfile
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from executor_procs import core_pids, descendants, serve_tiny as serve, wait_gone, worker_pids
from llmsvc.v1 import llmsvc_pb2 as pb
from llmsvc.v1 import llmsvc_pb2_grpc as pb_grpc
from tests.test_executors_server import SERVICE, SERVING, tiny_dir  # noqa: F401 - tiny_dir is a fixture


def _stream(max_tokens: int = 4000, text: str = "never ending"):
    return pb.GenerateRequest(text=text, stream=True, sampling=pb.SamplingParams(temperature=0.0),
                              stopping=pb.StoppingCriteria(max_tokens=max_tokens, ignore_eos=True))


class Follower:
    """Reads a stream on a thread: messages, then the status it ended with (None: still open)."""

    def __init__(self, call) -> None:
        self.call, self.msgs, self.code, self.ended_at = call, [], None, None
        self.first = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        try:
            for m in self.call:
                self.msgs.append(m)
                self.first.set()
            self.code = grpc.StatusCode.OK
        except grpc.RpcError as e:
            self.code = e.code()
        self.ended_at = time.monotonic()
        self.first.set()


def test_bad_input_fails_alone_then_core_sigkill_ends_streams_unavailable(tiny_dir):
    srv, channel = serve(tiny_dir)
    try:
        stub, health = pb_grpc.LlmServiceStub(channel), health_pb2_grpc.HealthStub(channel)
        (core,) = core_pids(srv.pid)
        assert worker_pids(srv.pid) == []  # --executor auto: the model runs in the core process
        # a stream cancelled, then one past its deadline, while nothing else runs: the core's
        # acknowledgement of the abort is read, so GetServerInfo shows the request gone, blocks free
        for how in ("cancel", "deadline"):
            call = stub.Generate(_stream(text=how), timeout=120 if how == "cancel" else 1.0)
            next(call)
            if how == "cancel":
                call.cancel()
            else:
                with pytest.raises(grpc.RpcError) as ei:
                    list(call)
                assert ei.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            deadline = time.monotonic() + 10
            while True:
                info = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=5)
                if info.num_running == 0 and info.num_free_kv_blocks == info.num_kv_blocks:
                    break
                assert time.monotonic() < deadline, (how, info)
                time.sleep(0.05)
        streams = [Follower(stub.Generate(_stream(text=f"stream {i}"), timeout=120)) for i in range(2)]
        assert all(s.first.wait(60) and s.msgs for s in streams)
        bad = [pb.GenerateRequest(text="x", sampling=pb.SamplingParams(temperature=-1.0)),
               pb.GenerateRequest(text="x", stopping=pb.StoppingCriteria(max_tokens=10_000)),
               pb.GenerateRequest(token_ids=pb.TokenIds(ids=[10**6]))]
        bad_regex = pb.GenerateRequest(text="x", sampling=pb.SamplingParams(regex="a(b"))
        bad.append(bad_regex)
        for req in bad:
            with pytest.raises(grpc.RpcError) as ei:
                list(stub.Generate(req, timeout=30))
            assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT, ei.value
        # the same bad constraint again once the core's own compile of it has failed (a constrained
        # request served in between, then a pause): the core finds the failure in its cache
        good = pb.GenerateRequest(text="x", sampling=pb.SamplingParams(regex="[a-z]{3}"),
                                  stopping=pb.StoppingCriteria(max_tokens=8))
        assert list(stub.Generate(good, timeout=60))[-1].finish.reason == pb.FinishInfo.REASON_STOP
        time.sleep(1.0)
        with pytest.raises(grpc.RpcError) as ei:
            list(stub.Generate(bad_regex, timeout=30))
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT, ei.value
        seen = [len(s.msgs) for s in streams]
        ok = stub.Generate(_stream(max_tokens=5, text="short"), timeout=60)
        assert sum(len(m.token_ids) for m in ok) == 5  # a good request next to them is served
        deadline = time.monotonic() + 30
        while not all(len(s.msgs) > n for s, n in zip(streams, seen)):  # the long streams kept going
            assert time.monotonic() < deadline and all(s.code is None for s in streams)
            time.sleep(0.05)
        assert health.Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=5).status == SERVING

        tree = descendants(srv.pid)
        os.kill(core, signal.SIGKILL)
        t_kill = time.monotonic()
        for s in streams:
            s.first.clear()
        deadline = t_kill + 10
        while any(s.code is None for s in streams) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [s.code for s in streams] == [grpc.StatusCode.UNAVAILABLE] * 2
        assert max(s.ended_at for s in streams) - t_kill < 2.0
        assert srv.proc.wait(30) != 0, "the server must exit non-zero by itself\n" + srv.log_tail()
        assert wait_gone(tree) == [], "child processes outlived the server"
        log = "".join(srv.lines)
        assert "died" in log and "NOT_SERVING" in log
    finally:
        channel.close()
        srv.kill()


def test_front_end_sigkill_takes_core_and_worker_down(tiny_dir, monkeypatch):
    tmp = tempfile.mkdtemp(prefix="llmsvc-t")  # short: it holds the core's ipc sockets
    monkeypatch.setenv("TMPDIR", tmp)
    srv, channel = serve(tiny_dir, "--executor", "multiproc")
    try:
        cores, workers = core_pids(srv.pid), worker_pids(srv.pid)
        assert len(cores) == 1 and len(workers) == 1, descendants(srv.pid)
        assert len(glob.glob(f"{tmp}/llmsvc-core-*")) == 1
        tree = descendants(srv.pid)
        srv.proc.kill()
        srv.proc.wait(10)
        assert wait_gone(tree) == [], "engine core or worker outlived the front end"
        assert glob.glob(f"{tmp}/llmsvc-core-*") == []  # the core removed the sockets' directory
    finally:
        channel.close()
        srv.kill()
        shutil.rmtree(tmp, ignore_errors=True)
