"""Shared helpers for the reliability suite (tests/test_reliability_*.py): a LIVE server on loopback
over the real engine, uniproc executor and a tiny random Llama with a small KV pool (so requests
get preempted), the post-conditions every abuse test ends with, and concurrent "witness" streams
whose greedy output must equal a reference run made on an idle server.

    from tests.reliability_utils import tiny_model_dir, live_server, assert_invariants, Witness
"""
from __future__ import annotations

import threading
import time

import grpc
from google.rpc import error_details_pb2, status_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmsvc.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from llmsvc.server.app import default_engine_factory
from llmsvc.v1 import llmsvc_pb2 as pb
from tests.server_harness import ServerThread, make_tiny_served_model_dir

SERVICE = "llmsvc.v1.LlmService"
ST = pb.StoppingCriteria
GREEDY = pb.SamplingParams(temperature=0.0)
MAX_MODEL_LEN = 256
BLOCK_SIZE = 16
NUM_BLOCKS = 24  # 384 tokens: two long requests already overflow it -> preemption


def tiny_model_dir(tmp_path_factory) -> str:
    """A tiny random Llama (vocab 259 = the byte-level tiny tokenizer) saved with its tokenizer."""
    return make_tiny_served_model_dir(tmp_path_factory.mktemp("rel-tiny"))


def tiny_config(model_dir: str, *, num_blocks: int = NUM_BLOCKS, max_num_seqs: int = 8,
                max_num_batched_tokens: int = 128, max_waiting_requests: int = 4096) -> EngineConfig:
    return EngineConfig(
        model_config=ModelConfig(model=model_dir, max_model_len=MAX_MODEL_LEN),
        cache_config=CacheConfig(block_size=BLOCK_SIZE, num_kv_blocks_override=num_blocks),
        scheduler_config=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                         max_waiting_requests=max_waiting_requests),
        device="cpu", log_stats_interval_s=0.0)


def live_server(model_dir: str, *, config_kw: dict | None = None, engine_wrapper=None, **server_kw) -> ServerThread:
    """A started, loaded server on 127.0.0.1 (caller stops it). `engine_wrapper(engine)` may patch
    the freshly built LLMEngine (fault injection) before the server warms it up."""
    make = default_engine_factory(tiny_config(model_dir, **(config_kw or {})))

    def factory():
        engine = make()
        if engine_wrapper is not None:
            engine_wrapper(engine)
        return engine
    return ServerThread(factory, **server_kw)


def server_info(s: ServerThread) -> pb.GetServerInfoResponse:
    return s.stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)


def health_status(s: ServerThread, service: str = SERVICE) -> int:
    return health_pb2_grpc.HealthStub(s.channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                        timeout=10).status


def assert_invariants(s: ServerThread, timeout: float = 30.0) -> pb.GetServerInfoResponse:
    """Wait (bounded) until every KV block is free (prefix-cached free blocks count as free) and no
    request is running or waiting; then the service must be SERVING and the engine thread alive."""
    end = time.monotonic() + timeout
    while True:
        info = server_info(s)
        if (info.num_free_kv_blocks == info.num_kv_blocks and info.num_running == 0
                and info.num_waiting == 0 and s.server.async_engine.num_in_flight == 0):
            break
        assert time.monotonic() < end, (f"leak: {info.num_free_kv_blocks}/{info.num_kv_blocks} blocks free, "
                                        f"{info.num_running} running, {info.num_waiting} waiting, "
                                        f"{s.server.async_engine.num_in_flight} streams")
        time.sleep(0.05)
    assert health_status(s) == health_pb2.HealthCheckResponse.SERVING
    assert s.server.async_engine.is_healthy and not s.server.engine_died
    core = s.engine.core  # the scheduler/pool's own bookkeeping agrees (read-only, engine idle)
    assert not core.scheduler.has_unfinished_requests()
    return info


def unpack_details(st: status_pb2.Status) -> dict:
    """The google.rpc details of a Status by type name: BadRequest, ErrorInfo, RetryInfo."""
    out = {}
    for a in st.details:
        for cls in (error_details_pb2.BadRequest, error_details_pb2.ErrorInfo, error_details_pb2.RetryInfo):
            if a.Is(cls.DESCRIPTOR):
                m = cls()
                a.Unpack(m)
                out[cls.__name__] = m
    return out


def rpc_details(e: grpc.RpcError) -> dict:
    """google.rpc details of a failed call by type name: BadRequest, ErrorInfo, RetryInfo."""
    md = dict(e.trailing_metadata() or ())
    if "grpc-status-details-bin" not in md:
        return {}
    return unpack_details(status_pb2.Status.FromString(md["grpc-status-details-bin"]))


def witness_request(i: int, max_tokens: int = 40) -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id=f"witness-{i}-{time.monotonic_ns()}", text=f"witness number {i} says",
                              stream=True, sampling=GREEDY, stopping=ST(max_tokens=max_tokens, ignore_eos=True))


def reference_tokens(s: ServerThread, req: pb.GenerateRequest) -> list[int]:
    """The greedy output of `req` run alone (unary) on the idle server."""
    ref = pb.GenerateRequest()
    ref.CopyFrom(req)
    ref.request_id, ref.stream = "", False
    (m,) = list(s.stub.Generate(ref, timeout=120))
    return list(m.token_ids)


class Witness:
    """A well-behaved greedy stream run in a thread while a test abuses the server.

    `start()` computes the reference first (server idle), then streams; `check()` joins and asserts
    the streamed token ids and text are exactly the reference's and the stream finished LENGTH."""

    def __init__(self, s: ServerThread, i: int = 0, max_tokens: int = 40, read_delay: float = 0.0) -> None:
        self.s, self.req, self.read_delay = s, witness_request(i, max_tokens), read_delay
        self.reference = reference_tokens(s, self.req)
        self.tokens: list[int] = []
        self.text = ""
        self.finish = None
        self.error: BaseException | None = None
        self.first_token = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> "Witness":
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            for m in self.s.stub.Generate(self.req, timeout=300):
                self.tokens += m.token_ids
                self.text += m.text
                if m.token_ids:
                    self.first_token.set()
                if m.HasField("finish"):
                    self.finish = m.finish
                if self.read_delay:
                    time.sleep(self.read_delay)
        except BaseException as e:  # noqa: BLE001 - reported by check()
            self.error = e
        finally:
            self.first_token.set()

    def check(self, timeout: float = 300.0) -> None:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "witness stream hung"
        assert self.error is None, f"witness failed: {self.error!r}"
        assert self.tokens == self.reference, "witness output differs from its reference run"
        assert self.finish is not None and self.finish.reason == pb.FinishInfo.REASON_LENGTH
        detok = self.s.stub.Detokenize(pb.DetokenizeRequest(token_ids=self.tokens), timeout=10).text
        assert self.text == detok
