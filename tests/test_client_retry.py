"""Retries of refused calls: the server refuses before its response headers and names its delay
twice (RetryInfo, and grpc-retry-pushback-ms for gRPC's retry policy); Client(max_retries=N)
retries such a refusal after that delay and never retries a stream that has started."""
from __future__ import annotations

import asyncio
import json
import threading
import time

import grpc
import pytest

from llmsvc.client import AsyncClient, Client
from llmsvc.client.channel import channel_options, retry_service_config
from llmsvc.client.errors import LlmsvcError
from llmsvc.v1 import llmsvc_pb2 as pb
from tests.server_harness import ServerThread, fake_engine_factory


def gen(max_tokens: int, stream: bool = True) -> pb.GenerateRequest:
    return pb.GenerateRequest(text="hello", stream=stream,
                              stopping=pb.StoppingCriteria(max_tokens=max_tokens, ignore_eos=True))


def test_retry_policy_covers_the_inference_service_only():
    cfg = json.loads(retry_service_config(2))
    (method,) = cfg["methodConfig"]
    assert method["name"] == [{"service": "llmsvc.v1.LlmService"}]
    # the sync client's channel: Generate has a config of its own without a policy
    service, generate = json.loads(retry_service_config(2, streams=False))["methodConfig"]
    assert service == method and "retryPolicy" not in generate
    assert generate["name"] == [{"service": "llmsvc.v1.LlmService", "method": "Generate"}]
    assert method["retryPolicy"]["maxAttempts"] == 3
    assert set(method["retryPolicy"]["retryableStatusCodes"]) == {"UNAVAILABLE", "RESOURCE_EXHAUSTED"}
    assert "grpc.service_config" not in dict(channel_options(0))
    assert dict(channel_options(4))["grpc.enable_retries"] == 1
    for bad in (-1, 5):
        with pytest.raises(ValueError, match="max_retries"):
            channel_options(bad)
        with pytest.raises(ValueError, match="max_retries"):
            Client("127.0.0.1:1", max_retries=bad)
        with pytest.raises(ValueError, match="max_retries"):
            AsyncClient("127.0.0.1:1", max_retries=bad)


@pytest.fixture()
def full_queue():
    """One sequence running (~1.5 s: 150 steps of 10 ms) and one waiting: the queue is full until
    the running one ends."""
    with ServerThread(fake_engine_factory(max_num_seqs=1, step_delay=0.01), max_waiting_requests=1) as s:
        running = s.stub.Generate(gen(150))
        next(running)
        waiting = s.stub.Generate(gen(5))
        waiting.initial_metadata()  # sent once the engine took it
        time.sleep(0.1)  # the engine's stats count it as waiting
        yield s, running, waiting
        running.cancel()
        waiting.cancel()


def test_refusal_is_headers_free_with_pushback(full_queue):
    s, running, waiting = full_queue
    call = s.stub.Generate(gen(4))
    with pytest.raises(grpc.RpcError) as ei:
        list(call)
    assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert dict(call.initial_metadata() or ()).get("x-request-id") is None
    assert dict(call.trailing_metadata())["grpc-retry-pushback-ms"] == "1000"
    assert dict(waiting.initial_metadata())["x-request-id"]  # an admitted call has its id before any token


def test_client_retries_a_full_queue_after_the_servers_delay(full_queue):
    s, running, waiting = full_queue
    with Client(s.address, timeout=30) as plain:
        with pytest.raises(LlmsvcError) as ei:
            plain.generate("hello", max_tokens=4, ignore_eos=True)
        assert ei.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED

    threading.Thread(target=lambda: [list(c) for c in (running, waiting)], daemon=True).start()
    t0 = time.monotonic()
    with Client(s.address, timeout=30, max_retries=4) as client:
        result = client.generate("hello", max_tokens=4, ignore_eos=True)
    elapsed = time.monotonic() - t0
    assert len(result.token_ids) == 4 and result.finish_reason == "length"
    assert elapsed >= 0.9, elapsed  # refused at least once, then waited the server's 1 s pushback


def test_async_client_retries_too(full_queue):
    s, running, waiting = full_queue
    threading.Thread(target=lambda: [list(c) for c in (running, waiting)], daemon=True).start()

    async def main():
        async with AsyncClient(s.address, timeout=30, max_retries=4) as client:
            return await client.generate("hello", max_tokens=3, ignore_eos=True)

    t0 = time.monotonic()
    result = asyncio.run(main())
    assert len(result.token_ids) == 3 and time.monotonic() - t0 >= 0.9


def test_a_started_stream_is_not_retried():
    """UNAVAILABLE after the first tokens (the engine died mid-stream) ends the call: a retry
    would repeat tokens the caller already has."""
    with ServerThread(fake_engine_factory(fail_after=30, step_delay=0.002)) as s:
        with Client(s.address, timeout=30, max_retries=4) as client:
            stream = client.generate_stream("hello", max_tokens=100, ignore_eos=True)
            got = []
            with pytest.raises(LlmsvcError) as ei:
                for msg in stream:
                    got.append(msg)
            assert ei.value.code == grpc.StatusCode.UNAVAILABLE
            assert got, "the failure came mid-stream"
            assert stream.request_id


def test_a_retry_to_a_server_that_went_away_ends_within_the_deadline():
    """Refused while draining, then the server is gone: grpcio's blocking retry of a
    server-streaming call hung past its deadline; the sync client retries Generate itself."""
    s = ServerThread(fake_engine_factory(step_delay=0.02))
    running = s.stub.Generate(gen(200))  # 4 s: outlasts the drain's grace
    next(running)

    async def drain():
        s.server.begin_drain(0.5)  # refusals (DRAINING, 1 s pushback), then the server stops
    s.call(drain())
    done = []

    def call():
        with Client(s.address, timeout=20, max_retries=2) as client:
            try:
                client.generate("hello", max_tokens=2)
            except LlmsvcError as e:
                done.append(e.code)

    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(40)
    running.cancel()
    s.stop()
    assert done == [grpc.StatusCode.UNAVAILABLE]
