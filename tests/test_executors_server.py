"""A REAL `python -m llmsvc serve --executor multiproc|tp` whose worker is SIGKILLed mid-stream:
the stream ends UNAVAILABLE within seconds, health turns NOT_SERVING, the server exits non-zero
by itself, and no child process or shared-memory segment is left behind."""
from __future__ import annotations

import os
import signal
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from executor_procs import alive, descendants, open_shm_of, serve_tiny as serve, shm_entries, wait_gone, \
    worker_pids
from llmsvc.v1 import llmsvc_pb2 as pb
from llmsvc.v1 import llmsvc_pb2_grpc as pb_grpc
from tests.server_harness import make_tiny_served_model_dir

SERVICE = "llmsvc.v1.LlmService"
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_served_model_dir(tmp_path_factory.mktemp("tiny"), max_position_embeddings=4096)




def _long_stream():
    return pb.GenerateRequest(text="never ending", stream=True, sampling=pb.SamplingParams(temperature=0.0),
                              stopping=pb.StoppingCriteria(max_tokens=4000, ignore_eos=True))


# tp: slow; tests/test_executors.py kills a tp rank mid-generation at the executor level
@pytest.mark.parametrize("executor,tp,victim", [("multiproc", 1, 0),
                                                pytest.param("tp", 2, 1, marks=pytest.mark.slow)])
def test_worker_sigkill_mid_stream_unavailable_not_serving_exit_nonzero(tiny_dir, executor, tp, victim):
    shm_before = shm_entries()
    srv, channel = serve(tiny_dir, "--executor", executor, "--tensor-parallel-size", str(tp))
    try:
        stub, health = pb_grpc.LlmServiceStub(channel), health_pb2_grpc.HealthStub(channel)
        statuses: list[int] = []
        watch = health.Watch(health_pb2.HealthCheckRequest(service=SERVICE), timeout=120)

        def follow():
            try:
                for r in watch:
                    statuses.append(r.status)
            except grpc.RpcError:
                pass

        watcher = threading.Thread(target=follow, daemon=True)
        watcher.start()
        call = stub.Generate(_long_stream(), timeout=120)
        assert next(call).token_ids  # the stream is producing
        workers = worker_pids(srv.pid)
        assert len(workers) == tp, (workers, descendants(srv.pid))
        tree = descendants(srv.pid)
        shm_used = open_shm_of([srv.pid, *tree])
        os.kill(workers[victim], signal.SIGKILL)
        t_kill = time.monotonic()
        with pytest.raises(grpc.RpcError) as ei:
            for _ in call:
                pass
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE, ei.value
        assert time.monotonic() - t_kill < 10.0, "the client waited too long for the failure"
        assert srv.proc.wait(30) != 0, "the server must exit non-zero by itself\n" + srv.log_tail()
        watcher.join(10)
        assert statuses[:1] == [SERVING] and NOT_SERVING in statuses, statuses
        assert wait_gone(tree) == [], "child processes outlived the server"
        leaked = {p for p in shm_used if os.path.exists(p)} | {f"/dev/shm/{e}" for e in shm_entries() - shm_before
                                                               if any(str(p) in e for p in [srv.pid, *tree])}
        assert not leaked, leaked
        log = "".join(srv.lines)
        assert "died" in log and "NOT_SERVING" in log
    finally:
        channel.close()
        srv.kill()


@pytest.mark.slow  # tests/test_shutdown.py covers SIGTERM with worker processes (multiproc)
def test_sigterm_tp_server_leaves_no_child(tiny_dir):
    srv, channel = serve(tiny_dir, "--executor", "tp", "--tensor-parallel-size", "2", "--shutdown-grace", "0")
    try:
        tree = descendants(srv.pid)
        assert len(worker_pids(srv.pid)) == 2
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(60) == 0, srv.log_tail()
        assert wait_gone(tree) == [], [p for p in tree if alive(p)]
    finally:
        channel.close()
        srv.kill()


def test_worker_death_while_idle_turns_not_serving_and_exits_nonzero(tiny_dir):
    """Nothing running: the engine thread's idle health check notices the dead worker."""
    srv, channel = serve(tiny_dir, "--executor", "multiproc")
    try:
        health = health_pb2_grpc.HealthStub(channel)
        watch = health.Watch(health_pb2.HealthCheckRequest(service=SERVICE), timeout=60)
        assert next(watch).status == SERVING
        tree = descendants(srv.pid)
        (worker,) = worker_pids(srv.pid)
        os.kill(worker, signal.SIGKILL)
        t_kill = time.monotonic()
        statuses = []
        try:
            for r in watch:
                statuses.append(r.status)
                if r.status == NOT_SERVING:
                    break
        except grpc.RpcError:
            pass
        assert NOT_SERVING in statuses and time.monotonic() - t_kill < 10.0, statuses
        assert srv.proc.wait(30) != 0, srv.log_tail()
        assert wait_gone(tree) == []
    finally:
        channel.close()
        srv.kill()
