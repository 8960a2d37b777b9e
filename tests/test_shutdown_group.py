"""SIGTERM to a REAL `llmsvc serve`'s whole process group (as systemd's default KillMode, or
`kill -- -PGID`, stops a service): the engine-core process and the workers leave the signal to
the front end, which drains as it does for a SIGTERM of its own (tests/test_shutdown.py): both
the grpc.health.v1 names and VllmEngine/HealthCheck turn unhealthy at once, new Generate calls on
both doors get UNAVAILABLE, the stream in flight on the engine door finishes, exit 0."""
from __future__ import annotations

import signal
import time

import grpc
import pytest

from llmsvc.server.vllm_engine.proto import vllm_engine_pb2 as vpb
from llmsvc.v1 import llmsvc_pb2 as pb
from llmsvc.v1 import llmsvc_pb2_grpc as pb_grpc
from tests.server_harness import make_tiny_served_model_dir
from tests.smg_utils import Replica


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_served_model_dir(tmp_path_factory.mktemp("tiny"), max_position_embeddings=4096)


def _engine_request(rid: str, max_tokens: int) -> vpb.GenerateRequest:
    return vpb.GenerateRequest(request_id=rid, tokenized=vpb.TokenizedInput(input_ids=[257, 104, 105]), stream=True,
                               sampling_params=vpb.SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                                  ignore_eos=True))


@pytest.mark.parametrize("executor", ["uniproc", pytest.param("multiproc", marks=pytest.mark.slow)])
def test_sigterm_to_the_process_group_drains_and_exits_0(tiny_dir, executor):
    r = Replica("replica", tiny_dir, ("--executor", executor, "--shutdown-grace", "60")).start()
    try:
        r.wait_serving()
        call = r.engine.Generate(_engine_request("in-flight", 150), timeout=120)
        first = next(call)
        assert first.HasField("chunk")
        r.proc.signal_group(signal.SIGTERM)  # every process of the server at once
        deadline = time.monotonic() + 10
        while r.engine.HealthCheck(vpb.HealthCheckRequest(), timeout=5).healthy:
            assert time.monotonic() < deadline, "VllmEngine/HealthCheck still healthy after SIGTERM"
            time.sleep(0.01)
        assert not r.serving() and not r.serving("llmsvc.v1.LlmService")
        with pytest.raises(grpc.RpcError) as ei:
            list(r.engine.Generate(_engine_request("late", 2), timeout=10))
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(grpc.RpcError) as ei:
            list(pb_grpc.LlmServiceStub(r.channel).Generate(pb.GenerateRequest(text="late"), timeout=10))
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
        rest = list(call)  # the request in flight runs to its end
        assert rest[-1].complete.finish_reason == "length"
        tokens = len(first.chunk.token_ids) + sum(len(m.chunk.token_ids) for m in rest if m.HasField("chunk"))
        assert tokens == 150 or rest[-1].complete.completion_tokens == 150
        assert r.proc.proc.wait(60) == 0, r.proc.tail(40)
    finally:
        r.close()
