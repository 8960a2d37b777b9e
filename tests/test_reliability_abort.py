"""Abort storms against a LIVE server (tiny random Llama, uniproc, 24-block KV pool so requests are
preempted): hundreds of requests cancelled by the client, aborted by RPC (twice), or cut by deadlines
at random moments (in the queue, during prefill, mid-decode, just after finish), aborts of unknown
ids. Every call ends with a status its action allows; afterwards every KV block is free, nothing is
left in the engine, the service is SERVING and the witness streams produced their reference output.
"""
from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from llmsvc.v1 import llmsvc_pb2 as pb
from tests.reliability_utils import GREEDY, ST, Witness, assert_invariants, live_server, tiny_model_dir

OK, CANCELLED, DEADLINE = grpc.StatusCode.OK, grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED
R = pb.FinishInfo


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    s = live_server(tiny_model_dir(tmp_path_factory))
    yield s
    s.stop()


def _request(rng: random.Random, rid: str, stream: bool = True) -> pb.GenerateRequest:
    n_prompt = rng.choice([3, 20, 120, 200])  # 120/200: multi-chunk prefill (budget 128 tokens/step)
    return pb.GenerateRequest(
        request_id=rid, token_ids=pb.TokenIds(ids=[rng.randrange(3, 255) for _ in range(n_prompt)]),
        stream=stream, sampling=pb.SamplingParams(temperature=rng.choice([0.0, 0.8]), seed=rng.randrange(1 << 30),
                                                  n=rng.choice([1, 1, 1, 2])),
        stopping=ST(max_tokens=rng.randint(1, 250 - n_prompt), ignore_eos=rng.random() < 0.7))


class Storm:
    """Runs one randomly chosen abuse per request id and records what each call ended with."""

    def __init__(self, s, seed: int) -> None:
        self.s, self.seed = s, seed
        self.outcomes: dict[str, set] = {}
        self.lock = threading.Lock()

    def _record(self, action: str, what) -> None:
        with self.lock:
            self.outcomes.setdefault(action, set()).add(what)

    def _abort(self, *ids: str) -> pb.AbortResponse:
        return self.s.stub.Abort(pb.AbortRequest(request_ids=list(ids), reason="storm"), timeout=30)

    def run_one(self, i: int) -> None:
        rng = random.Random(self.seed * 100_003 + i)
        rid = f"storm-{self.seed}-{i}"
        action = rng.choice(["cancel_queued", "cancel_prefill", "cancel_mid", "abort_early", "abort_mid",
                             "abort_after_finish", "deadline", "unary_deadline", "unary_abort", "unknown_abort"])
        req = _request(rng, rid, stream=not action.startswith("unary"))
        stub = self.s.stub
        if action == "unknown_abort":
            resp = self._abort(f"nobody-{i}", f"nobody-{i}", "")
            assert not resp.aborted and len(resp.not_found) == 3
            return self._record(action, "not_found")
        if action in ("deadline", "unary_deadline"):
            try:
                msgs = list(stub.Generate(req, timeout=rng.uniform(0.001, 0.6)))
                assert msgs[-1].HasField("finish")
                return self._record(action, OK)
            except grpc.RpcError as e:
                assert e.code() == DEADLINE, (rid, e.code(), e.details())
                return self._record(action, DEADLINE)
        if action == "unary_abort":
            call = stub.Generate(req, timeout=120)  # unary_stream: starts now, read below
            time.sleep(rng.uniform(0, 0.2))
            self._abort(rid)
            msgs = list(call)
            assert msgs and all(m.HasField("finish") for m in msgs)
            return self._record(action, msgs[0].finish.reason)
        call = stub.Generate(req, timeout=120)
        if action == "cancel_queued":
            call.cancel()
            return self._record(action, "cancelled")
        call.initial_metadata()  # sent before prefill: the request is admitted
        if action == "cancel_prefill":
            time.sleep(rng.uniform(0, 0.05))
            call.cancel()
            return self._record(action, "cancelled")
        if action == "abort_early":
            resp = self._abort(rid, rid)  # duplicate ids in one Abort
            resp2 = self._abort(rid)  # and a second Abort: idempotent
            assert rid in list(resp.aborted) + list(resp.not_found) and len(resp2.aborted) <= 1
        msgs = []
        try:
            for m in call:
                msgs.append(m)
                if action == "cancel_mid" and len(msgs) == 2:
                    call.cancel()
                    return self._record(action, "cancelled")
                if action == "abort_mid" and len(msgs) == 2:
                    self._abort(rid)
                    self._abort(rid)
        except grpc.RpcError as e:
            assert e.code() == CANCELLED and action == "cancel_mid", (rid, action, e.code(), e.details())
            return self._record(action, "cancelled")
        finals = [m for m in msgs if m.HasField("finish")]
        assert len(finals) == max(1, req.sampling.n), (rid, action, len(finals))
        reasons = {m.finish.reason for m in finals}
        assert reasons <= {R.REASON_ABORTED, R.REASON_LENGTH, R.REASON_STOP}, (rid, reasons)
        if R.REASON_ABORTED in reasons:
            assert action in ("abort_early", "abort_mid")
            assert all(m.finish.abort_reason for m in finals if m.finish.reason == R.REASON_ABORTED)
        if action == "abort_after_finish":
            resp = self._abort(rid, rid)
            assert set(resp.not_found) == {rid} and not resp.aborted  # finished: nothing to abort
        for r in reasons:
            self._record(action, r)


@pytest.mark.parametrize("seed", [1, 2])
def test_abort_storm_leaves_nothing_behind(srv, seed):
    witnesses = [Witness(srv, i, max_tokens=50).start() for i in range(2)]
    storm = Storm(srv, seed=seed)
    with ThreadPoolExecutor(12) as pool:
        for f in [pool.submit(storm.run_one, i) for i in range(300)]:
            f.result(timeout=300)
    for w in witnesses:
        w.check()
    info = assert_invariants(srv)
    assert info.num_kv_blocks == 24
    # the storm reached the moments it was meant to reach
    assert storm.outcomes["deadline"] >= {DEADLINE}
    assert R.REASON_ABORTED in storm.outcomes["abort_mid"] | storm.outcomes["abort_early"]
    assert srv.server.async_engine.get_stats().num_preemptions > 0
    # and the server still serves a fresh request exactly
    (m,) = list(srv.stub.Generate(pb.GenerateRequest(text="after the storm", sampling=GREEDY,
                                                     stopping=ST(max_tokens=8, ignore_eos=True)), timeout=60))
    assert len(m.token_ids) == 8


def test_reused_id_after_abort_is_served(srv):
    rid = "reuse-me"
    for _ in range(20):  # abort then immediately reuse: ALREADY_EXISTS until the engine confirms, then OK
        call = srv.stub.Generate(pb.GenerateRequest(request_id=rid, text="again", stream=True,
                                                    stopping=ST(max_tokens=200, ignore_eos=True)), timeout=60)
        next(call)
        srv.stub.Abort(pb.AbortRequest(request_ids=[rid]), timeout=10)
        assert list(call)[-1].finish.reason == R.REASON_ABORTED
        (m,) = list(srv.stub.Generate(pb.GenerateRequest(request_id=rid, text="again",
                                                         stopping=ST(max_tokens=2, ignore_eos=True)), timeout=60))
        assert m.request_id == rid and len(m.token_ids) == 2
    assert_invariants(srv)
