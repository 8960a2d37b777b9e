"""Faults inside the engine of a LIVE server run the way the CLI runs it (`LlmServer.serve`): an
exception raised inside a step (injected by wrapping the uniproc executor's execute_model) fails the
requests in flight with INTERNAL (UNAVAILABLE when it is a worker failure, ExecutorError), health
turns NOT_SERVING, new requests get UNAVAILABLE, and serve() returns exit code 1 so that the
orchestrator restarts the process instead of it serving garbage.
"""
from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from executors.base import ExecutorError
from llmsvc.server.app import LlmServer, default_engine_factory
from llmsvc.v1 import llmsvc_pb2 as pb
from llmsvc.v1 import llmsvc_pb2_grpc as pb_grpc
from tests.reliability_utils import SERVICE, ST, rpc_details, tiny_config, tiny_model_dir

NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory)


class ServeThread:
    """`LlmServer.serve(stop)` on its own loop and thread; `exit_code()` waits for its return."""

    def __init__(self, engine_factory) -> None:
        self.server = LlmServer(engine_factory, host="127.0.0.1", port=0)
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.stop = asyncio.run_coroutine_threadsafe(self._make_event(), self.loop).result(10)
        self.done = asyncio.run_coroutine_threadsafe(self.server.serve(self.stop), self.loop)
        end = time.monotonic() + 120
        while not self.server.state.ready:
            assert time.monotonic() < end and not self.done.done(), "server did not become ready"
            time.sleep(0.02)
        self.channel = grpc.insecure_channel(self.server.address)
        self.stub = pb_grpc.LlmServiceStub(self.channel)

    @staticmethod
    async def _make_event() -> asyncio.Event:
        return asyncio.Event()

    def exit_code(self, timeout: float = 60.0) -> int:
        return self.done.result(timeout)

    def close(self) -> None:
        self.channel.close()
        if not self.done.done():
            self.loop.call_soon_threadsafe(self.stop.set)
            self.done.result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)


def faulty_factory(model_dir: str, trigger: threading.Event, exc: BaseException):
    make = default_engine_factory(tiny_config(model_dir))

    def factory():
        engine = make()
        executor = engine.core.executor
        inner = executor.execute_model

        def execute_model(so):
            if trigger.is_set():
                raise exc
            return inner(so)
        executor.execute_model = execute_model
        return engine
    return factory


@pytest.mark.parametrize("exc,code,reason", [
    (RuntimeError("injected: index out of range in the model"), grpc.StatusCode.INTERNAL, "ENGINE_ERROR"),
    (ExecutorError("injected: worker died"), grpc.StatusCode.UNAVAILABLE, "ENGINE_DEAD"),
], ids=["step-exception", "worker-failure"])
def test_fault_in_step_fails_in_flight_then_not_serving_and_exit_1(model_dir, exc, code, reason):
    trigger = threading.Event()
    st = ServeThread(faulty_factory(model_dir, trigger, exc))
    try:
        calls = [st.stub.Generate(pb.GenerateRequest(request_id=f"victim-{i}", text=f"victim {i}", stream=True,
                                                     stopping=ST(max_tokens=200, ignore_eos=True)), timeout=60)
                 for i in range(3)]
        for c in calls:
            next(c)  # each is mid-decode
        unary = st.stub.Generate(pb.GenerateRequest(text="unary victim", stopping=ST(max_tokens=200, ignore_eos=True)),
                                 timeout=60)
        end = time.monotonic() + 30
        while st.stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=5).num_running < 4:
            assert time.monotonic() < end, "the unary request never started running"
            time.sleep(0.01)
        trigger.set()
        for i, c in enumerate(calls + [unary]):
            with pytest.raises(grpc.RpcError) as ei:
                for _ in c:
                    pass
            e = ei.value
            assert e.code() == code, (e.code(), e.details())
            assert "Traceback" not in e.details() and "File " not in e.details()
            d = rpc_details(e)
            assert d["ErrorInfo"].reason == reason
            if code == grpc.StatusCode.INTERNAL and i < 3:
                assert d["ErrorInfo"].metadata["request_id"] == f"victim-{i}"
        # the process reports itself unhealthy, refuses new work, and exits non-zero
        assert st.exit_code() == 1
        assert st.server.engine_died
        health = st.server.health.servicer
        assert asyncio.run_coroutine_threadsafe(_status(health), st.loop).result(10) == NOT_SERVING
        with pytest.raises(grpc.RpcError) as ei:
            list(st.stub.Generate(pb.GenerateRequest(text="after"), timeout=10))
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE  # stopped: nothing is served any more
    finally:
        st.close()


async def _status(servicer) -> int:
    return (await servicer.Check(health_pb2.HealthCheckRequest(service=SERVICE), None)).status


def test_health_not_serving_before_exit(model_dir):
    """Between the fault and the exit the health service already answers NOT_SERVING and new
    Generate calls get UNAVAILABLE with RetryInfo (a slow shutdown is simulated by holding serve())."""
    trigger = threading.Event()
    st = ServeThread(faulty_factory(model_dir, trigger, RuntimeError("injected")))
    gate = threading.Event()
    orig_shutdown = st.server.shutdown

    async def held_shutdown(grace: float = 30.0):
        await asyncio.to_thread(gate.wait, 30)
        await orig_shutdown(grace)
    st.server.shutdown = held_shutdown
    try:
        call = st.stub.Generate(pb.GenerateRequest(text="x", stream=True, stopping=ST(max_tokens=200, ignore_eos=True)),
                                timeout=60)
        next(call)
        trigger.set()
        with pytest.raises(grpc.RpcError):
            list(call)
        h = health_pb2_grpc.HealthStub(st.channel)
        end = time.monotonic() + 10
        while h.Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=5).status != NOT_SERVING:
            assert time.monotonic() < end
            time.sleep(0.02)
        with pytest.raises(grpc.RpcError) as ei:
            list(st.stub.Generate(pb.GenerateRequest(text="new"), timeout=10))
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE and "RetryInfo" in rpc_details(ei.value)
        assert not st.done.done()
        gate.set()
        assert st.exit_code() == 1
    finally:
        gate.set()
        st.close()
