"""OpenTelemetry spans of Generate calls: one SERVER span per call, child of the caller's
traceparent, GenAI attributes, ERROR status for failures; exported over OTLP/gRPC to a
collector (an in-process one here) and flushed at shutdown."""
from __future__ import annotations

import argparse
import sys
import threading
import time
from concurrent import futures

import grpc
import pytest

pytest.importorskip("opentelemetry.sdk.trace")
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402
from opentelemetry.trace import SpanKind, StatusCode  # noqa: E402

from llmsvc.server import cli  # noqa: E402
from llmsvc.server.tracing import SPAN_NAME, RequestTracer  # noqa: E402
from llmsvc.v1 import llmsvc_pb2 as pb  # noqa: E402
from tests.server_harness import ServerThread, fake_engine_factory  # noqa: E402

ST = pb.StoppingCriteria
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN = "00f067aa0ba902b7"
TRACEPARENT = (("traceparent", f"00-{TRACE_ID}-{PARENT_SPAN}-01"),)


def spans(exporter: InMemorySpanExporter, n: int = 1, timeout: float = 10.0) -> list:
    """The n finished spans, once written: a call's span ends in the handler's last step, which
    may come after the client has its status."""
    end = time.monotonic() + timeout
    while len(found := exporter.get_finished_spans()) < n:
        assert time.monotonic() < end, f"{len(found)} spans, expected {n}"
        time.sleep(0.01)
    return list(found)


@pytest.fixture
def traced():
    exporter = InMemorySpanExporter()
    s = ServerThread(fake_engine_factory(), tracer=RequestTracer(processor=SimpleSpanProcessor(exporter)))
    yield s, exporter
    s.stop()


def test_a_span_per_call_child_of_the_callers_trace(traced):
    s, exporter = traced
    req = pb.GenerateRequest(request_id="t-1", text="hello", stream=True, sampling=pb.SamplingParams(n=2),
                             stopping=ST(max_tokens=4))
    msgs = list(s.stub.Generate(req, metadata=TRACEPARENT))
    assert sum(1 for m in msgs if m.HasField("finish")) == 2
    (span,) = spans(exporter)
    assert span.name == SPAN_NAME and span.kind == SpanKind.SERVER
    assert format(span.context.trace_id, "032x") == TRACE_ID and format(span.parent.span_id, "016x") == PARENT_SPAN
    a = span.attributes
    assert a["gen_ai.request.id"] == "t-1" and a["gen_ai.request.n"] == 2 and a["gen_ai.request.max_tokens"] == 4
    assert a["gen_ai.usage.prompt_tokens"] == msgs[0].prompt.num_prompt_tokens
    assert a["gen_ai.usage.completion_tokens"] == 8 and list(a["gen_ai.response.finish_reasons"]) == ["length"] * 2
    assert 0 <= a["gen_ai.latency.time_in_queue"] <= a["gen_ai.latency.time_to_first_token"] <= a["gen_ai.latency.e2e"]
    assert a["rpc.grpc.status_code"] == 0 and span.status.status_code == StatusCode.UNSET
    assert span.end_time - span.start_time >= a["gen_ai.latency.e2e"] * 1e9 * 0.5  # the span covers the call


def test_failures_mark_the_span_and_calls_without_a_trace_start_one(traced):
    s, exporter = traced
    with pytest.raises(grpc.RpcError):
        list(s.stub.Generate(pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(temperature=-1))))
    (bad,) = spans(exporter)
    assert bad.status.status_code == StatusCode.ERROR and "INVALID_ARGUMENT" in bad.status.description
    assert bad.attributes["rpc.grpc.status_code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "gen_ai.usage.completion_tokens" not in bad.attributes  # it never reached the engine
    assert bad.parent is None  # no traceparent: a root span
    exporter.clear()
    (m,) = list(s.stub.Generate(pb.GenerateRequest(text="hi", stopping=ST(max_tokens=2))))
    (ok,) = spans(exporter)
    assert ok.attributes["gen_ai.request.id"] == m.request_id and ok.parent is None


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace collector that keeps what it is sent."""

    def __init__(self) -> None:
        self.spans: list = []  # (resource attributes, span)
        self.lock = threading.Lock()

    def Export(self, request, context):
        with self.lock:
            for rs in request.resource_spans:
                resource = {kv.key: kv.value.string_value for kv in rs.resource.attributes}
                for ss in rs.scope_spans:
                    self.spans.extend((resource, sp) for sp in ss.spans)
        return trace_service_pb2.ExportTraceServiceResponse()


def test_spans_reach_an_otlp_collector_by_the_serve_flag():
    collector = Collector()
    server = grpc.server(futures.ThreadPoolExecutor(2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        p = argparse.ArgumentParser()
        cli.add_arguments(p)
        opts = cli.tracing_options(p.parse_args(["--otlp-traces-endpoint", f"http://127.0.0.1:{port}"]))
        s = ServerThread(fake_engine_factory(), **opts)
        try:
            list(s.stub.Generate(pb.GenerateRequest(request_id="otlp-1", text="hi", stopping=ST(max_tokens=3)),
                                 metadata=TRACEPARENT))
        finally:
            s.stop()  # flushes the batch to the collector
        ((resource, span),) = collector.spans
        assert resource["service.name"] == "llmsvc" and span.name == SPAN_NAME
        assert span.trace_id.hex() == TRACE_ID and span.parent_span_id.hex() == PARENT_SPAN
        attrs = {kv.key: kv.value for kv in span.attributes}
        assert attrs["gen_ai.request.id"].string_value == "otlp-1"
        assert attrs["gen_ai.usage.completion_tokens"].int_value == 3
    finally:
        server.stop(None)


def test_tracing_flag_without_the_otel_extra_is_a_configuration_error(monkeypatch):
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    assert cli.tracing_options(p.parse_args([])) == {}
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)
    with pytest.raises(ValueError, match=r"pip install 'llmsvc\[otel\]'"):
        cli.tracing_options(p.parse_args(["--otlp-traces-endpoint", "http://127.0.0.1:4317"]))
