"""Overload against a LIVE server (tiny random Llama, uniproc): past max_waiting_requests new calls
get RESOURCE_EXHAUSTED with RetryInfo while the admitted ones complete exactly; a slow reader gets
fewer, coalesced messages whose concatenation is still exact; a reader that stalls past the backlog
cap is aborted with RESOURCE_EXHAUSTED while a witness stream keeps progressing. Then the invariants.

The slow reader's channel advertises a 1 KiB HTTP/2 stream window (no BDP probing), like a client on a
slow link, and the messages are made big (a 256-character request id echoed in each, top-20 logprobs
with token text): flow control, not grpc's buffers, then pushes back on the server's writes.
"""
from __future__ import annotations

import threading
import time

import grpc
import pytest

from llmsvc.v1 import llmsvc_pb2 as pb
from llmsvc.v1 import llmsvc_pb2_grpc as pb_grpc
from tests.reliability_utils import (GREEDY, ST, Witness, assert_invariants, live_server, rpc_details,
                                     server_info, tiny_model_dir)

R = pb.FinishInfo


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory)


def _wait(cond, timeout: float = 60.0, what: str = "condition"):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_queue_cap_rejects_with_retry_info_and_admitted_complete(model_dir):
    s = live_server(model_dir, config_kw=dict(max_num_seqs=2), max_waiting_requests=2)
    try:
        admitted = [Witness(s, i, max_tokens=200) for i in range(4)]  # 2 running + 2 waiting
        for w in admitted[:2]:  # one at a time: admission counts "waiting" from the last step's stats
            w.start()
            w.first_token.wait(60)
        for k, w in enumerate(admitted[2:], start=1):
            w.start()
            _wait(lambda: server_info(s).num_waiting == k, what=f"{k} waiting")
        rejected = 0
        for i in range(6):
            with pytest.raises(grpc.RpcError) as ei:
                list(s.stub.Generate(pb.GenerateRequest(text=f"extra {i}", stopping=ST(max_tokens=4)), timeout=30))
            e = ei.value
            assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (e.code(), e.details())
            assert "max_waiting_requests" in e.details()
            d = rpc_details(e)
            assert d["RetryInfo"].retry_delay.seconds + d["RetryInfo"].retry_delay.nanos > 0
            assert d["ErrorInfo"].reason == "QUEUE_FULL"
            rejected += 1
        assert rejected == 6
        for w in admitted:
            w.check()
        assert_invariants(s)
        (m,) = list(s.stub.Generate(pb.GenerateRequest(text="room again", stopping=ST(max_tokens=3)), timeout=30))
        assert m.finish.reason in (R.REASON_LENGTH, R.REASON_STOP)
    finally:
        s.stop()


SLOW_LINK = (("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0))


def big_request(rid: str, max_tokens: int = 200) -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id=rid.ljust(256, "."), text="slow reader", stream=True, sampling=GREEDY,
                              stopping=ST(max_tokens=max_tokens, ignore_eos=True),
                              output=pb.OutputOptions(logprobs=20, token_text=True))


def test_slow_reader_gets_coalesced_exact_output(model_dir):
    s = live_server(model_dir)
    try:
        fast = list(s.stub.Generate(big_request("fast"), timeout=120))
        slow = []
        with grpc.insecure_channel(s.address, options=SLOW_LINK) as ch:
            for m in pb_grpc.LlmServiceStub(ch).Generate(big_request("slow"), timeout=120):
                slow.append(m)
                time.sleep(0.05)
        tokens = lambda msgs: [t for m in msgs for t in m.token_ids]  # noqa: E731
        assert tokens(slow) == tokens(fast) and len(tokens(fast)) == 200
        assert "".join(m.text for m in slow) == "".join(m.text for m in fast)
        assert [lp.token_id for m in slow for lp in m.logprobs] == tokens(fast)
        assert len(slow) < len(fast)  # several deltas were merged into one message
        assert slow[-1].finish.reason == R.REASON_LENGTH and slow[-1].num_output_tokens == 200
        assert_invariants(s)
    finally:
        s.stop()


def test_stalled_reader_past_backlog_cap_is_aborted_without_stalling_others(model_dir):
    s = live_server(model_dir, max_backlog_bytes=8 << 10)
    try:
        witness = Witness(s, 0, max_tokens=150)
        ch = grpc.insecure_channel(s.address, options=SLOW_LINK)
        call = pb_grpc.LlmServiceStub(ch).Generate(big_request("stalled", max_tokens=220), timeout=120)
        first = next(call)  # admitted; now stop reading
        witness.start()
        witness.check()  # the witness finished while the stalled stream was not read at all
        _wait(lambda: s.server.async_engine.num_in_flight == 0, what="the stalled request to be aborted")
        msgs = []
        with pytest.raises(grpc.RpcError) as ei:
            for m in call:
                msgs.append(m)
        e = ei.value
        assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (e.code(), e.details())
        assert "too slowly" in e.details() and rpc_details(e)["ErrorInfo"].reason == "OUTPUT_BACKLOG"
        assert first.request_id.startswith("stalled") and not any(m.HasField("finish") for m in msgs)
        assert sum(len(m.token_ids) for m in [first] + msgs) < 220
        assert_invariants(s)
        ch.close()
    finally:
        s.stop()
