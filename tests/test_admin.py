"""llmsvc.v1.AdminService over loopback (fake engine): its own tokens, Drain, FlushCache."""
from __future__ import annotations

import asyncio
import json
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmsvc.client.client import Client
from llmsvc.client.errors import FailedPrecondition, LlmsvcError, Unauthenticated
from llmsvc.server.app import LlmServer
from llmsvc.v1 import llmsvc_pb2 as pb
from llmsvc.v1 import llmsvc_pb2_grpc as pb_grpc
from tests.server_harness import ServerThread, fake_engine_factory
from tests.test_server import free_blocks_back

ST = pb.StoppingCriteria
PROMPT = "abcdefghijklmnopqrstuvwxyz"  # 27 tokens with BOS: six full 4-token blocks to cache


def bearer(token: str) -> tuple:
    return (("authorization", f"Bearer {token}"),)


def admin_stub(s: ServerThread) -> pb_grpc.AdminServiceStub:
    return pb_grpc.AdminServiceStub(s.channel)


def code_of(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as ei:
        call()
    return ei.value.code(), ei.value.details()


def cached_tokens(stub, metadata=None) -> int:
    (m,) = list(stub.Generate(pb.GenerateRequest(text=PROMPT, stopping=ST(max_tokens=2)), metadata=metadata))
    return m.prompt.num_cached_tokens


def test_admin_is_off_without_admin_tokens():
    s = ServerThread(fake_engine_factory())
    try:
        for rpc, req in ((admin_stub(s).Drain, pb.DrainRequest()), (admin_stub(s).FlushCache, pb.FlushCacheRequest())):
            code, details = code_of(lambda: rpc(req, timeout=10))
            assert code == grpc.StatusCode.PERMISSION_DENIED and "--admin-token-file" in details
        # nothing happened: still serving, the cache still warm
        cached_tokens(s.stub)
        assert cached_tokens(s.stub) > 0
    finally:
        s.stop()


def test_admin_tokens_are_apart_from_inference_tokens():
    s = ServerThread(fake_engine_factory(), auth_tokens=["infer"], admin_tokens=["root"])
    try:
        admin = admin_stub(s)
        for md in (None, bearer("infer"), bearer("wrong")):
            assert code_of(lambda: admin.FlushCache(pb.FlushCacheRequest(), metadata=md, timeout=10))[0] == \
                grpc.StatusCode.UNAUTHENTICATED
        # an admin token does not grant inference
        assert code_of(lambda: cached_tokens(s.stub, bearer("root")))[0] == grpc.StatusCode.UNAUTHENTICATED
        cached_tokens(s.stub, bearer("infer"))
        assert cached_tokens(s.stub, bearer("infer")) > 0
        admin.FlushCache(pb.FlushCacheRequest(), metadata=bearer("root"), timeout=10)
        assert cached_tokens(s.stub, bearer("infer")) == 0  # computed afresh
        assert cached_tokens(s.stub, bearer("infer")) > 0
    finally:
        s.stop()


def test_flush_cache_refused_while_a_request_holds_blocks():
    s = ServerThread(fake_engine_factory(step_delay=0.02), admin_tokens=["root"])
    try:
        stream = s.stub.Generate(pb.GenerateRequest(text=PROMPT, stream=True, stopping=ST(max_tokens=60)))
        first = next(stream)
        assert first.request_id
        with Client(s.address, token="root") as c, pytest.raises(FailedPrecondition) as ei:
            c.flush_cache()
        assert ei.value.reason == "KV_BLOCKS_IN_USE"
        rest = list(stream)  # the request goes on undisturbed
        assert rest[-1].finish.reason == pb.FinishInfo.REASON_LENGTH and rest[-1].num_output_tokens == 60
        free_blocks_back(s)
        with Client(s.address, token="root") as c:
            c.flush_cache()  # idle now
        assert cached_tokens(s.stub) == 0
    finally:
        s.stop()


def test_drain_finishes_in_flight_refuses_new_and_is_idempotent():
    s = ServerThread(fake_engine_factory(step_delay=0.02), admin_tokens=["root"])
    try:
        admin, md = admin_stub(s), bearer("root")
        assert code_of(lambda: admin.Drain(pb.DrainRequest(grace_seconds=-1), metadata=md, timeout=10))[0] == \
            grpc.StatusCode.INVALID_ARGUMENT
        assert code_of(lambda: admin.Drain(pb.DrainRequest(grace_seconds=float("nan")), metadata=md,
                                           timeout=10))[0] == grpc.StatusCode.INVALID_ARGUMENT
        stream = s.stub.Generate(pb.GenerateRequest(text="hello", stream=True, stopping=ST(max_tokens=40)))
        next(stream)
        resp = admin.Drain(pb.DrainRequest(grace_seconds=20), metadata=md, timeout=10)
        assert (resp.num_running, resp.already_draining, resp.grace_seconds) == (1, False, 20.0)
        again = admin.Drain(pb.DrainRequest(grace_seconds=1), metadata=md, timeout=10)
        assert again.already_draining and again.grace_seconds == 20.0  # the first drain's terms hold
        health = health_pb2_grpc.HealthStub(s.channel)
        status = health.Check(health_pb2.HealthCheckRequest(service="llmsvc.v1.LlmService"), timeout=5).status
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING
        code, _ = code_of(lambda: list(s.stub.Generate(pb.GenerateRequest(text="new", stopping=ST(max_tokens=2)),
                                                       timeout=10)))
        assert code == grpc.StatusCode.UNAVAILABLE
        rest = list(stream)
        assert rest[-1].finish.reason == pb.FinishInfo.REASON_LENGTH and rest[-1].num_output_tokens == 40
    finally:
        s.stop()  # waits for the drain the RPC began


def test_drain_rpc_ends_serve_with_exit_code_zero():
    server = LlmServer(fake_engine_factory(), host="127.0.0.1", port=0, admin_tokens=["root"])
    loop = asyncio.new_event_loop()
    result: dict = {}

    def run() -> None:
        result["code"] = loop.run_until_complete(server.serve(asyncio.Event()))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    try:
        end = time.monotonic() + 60
        while not server.state.ready:
            assert time.monotonic() < end and t.is_alive(), "server did not become ready"
            time.sleep(0.02)
        with Client(server.address, token="root") as c:
            assert not c.drain(grace_seconds=0).already_draining
            with pytest.raises(LlmsvcError):  # the server goes away
                for _ in range(200):
                    c.server_info(timeout=1)
                    time.sleep(0.05)
        t.join(30)
        assert not t.is_alive() and result["code"] == 0
    finally:
        if t.is_alive():
            asyncio.run_coroutine_threadsafe(server.shutdown(0.0), loop).result(30)
            t.join(10)
        loop.close()


def test_client_admin_calls_raise_typed_errors():
    s = ServerThread(fake_engine_factory(), admin_tokens=["root"])
    try:
        with Client(s.address) as c, pytest.raises(Unauthenticated):
            c.flush_cache()
        with Client(s.address, token="root") as c:
            c.flush_cache()
    finally:
        s.stop()


def test_admin_cli(capsys, monkeypatch):
    from llmsvc.__main__ import main as llmsvc_main

    s = ServerThread(fake_engine_factory(), admin_tokens=["root"])
    try:
        def run(*argv):
            rc = llmsvc_main(["admin", "--server", s.address, *argv])
            out, err = capsys.readouterr()
            return rc, out, err

        rc, _, err = run("flush-cache")  # no token
        assert rc == 1 and "UNAUTHENTICATED" in err
        assert run("--token", "root", "flush-cache")[:2] == (0, '{"flushed": true}\n')
        monkeypatch.setenv("LLMSVC_ADMIN_TOKEN", "root")
        rc, out, _ = run("drain", "--grace", "0")
        assert rc == 0 and json.loads(out) == {"draining": True, "already_draining": False, "grace_seconds": 0.0,
                                               "num_running": 0, "num_waiting": 0}
    finally:
        s.stop()
    rc = llmsvc_main(["admin", "--server", "127.0.0.1:1", "--timeout", "2", "flush-cache"])
    err = capsys.readouterr().err
    assert rc == 2 and ("UNAVAILABLE" in err or "DEADLINE_EXCEEDED" in err)
