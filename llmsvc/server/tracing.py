"""OpenTelemetry traces of Generate calls (`--otlp-traces-endpoint`), as vLLM and TGI export them.

One SERVER span per Generate call, named "llmsvc.v1.LlmService/Generate", from the call's
arrival to its end. Its parent is the caller's W3C trace context (`traceparent` and
`tracestate` metadata), so the span joins the client's trace. Attributes follow the GenAI
semantic conventions vLLM uses (`gen_ai.request.*`, `gen_ai.usage.*`, `gen_ai.latency.*`),
plus `rpc.grpc.status_code`. A call that ends with a status other than OK or CANCELLED marks
the span ERROR.

The span is written when the call ends, from what the call learnt (the final RequestOutput's
times), so tracing adds nothing per token. The OpenTelemetry SDK and its OTLP/gRPC exporter are
the `otel` extra; this module imports them only when tracing is on. The tracer provider is ours,
not the process-global one, so an application embedding LlmServer keeps its own.
"""
from __future__ import annotations

import logging
from typing import Any

import grpc

logger = logging.getLogger("llmsvc.server")

SPAN_NAME = "llmsvc.v1.LlmService/Generate"
INSTALL_HINT = "tracing needs the otel extra: pip install 'llmsvc[otel]'"


class RequestTracer:
    """Exports one span per Generate call. `processor`: an OpenTelemetry SpanProcessor (tests use
    an in-memory exporter); else a batching processor over an OTLP/gRPC exporter to `endpoint`
    (e.g. http://collector:4317; http means plaintext)."""

    def __init__(self, endpoint: str | None = None, *, processor=None, service_name: str = "llmsvc") -> None:
        try:
            from opentelemetry.propagators.textmap import DefaultGetter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.trace import SpanKind, Status, StatusCode
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
        except ImportError as e:
            raise RuntimeError(f"{INSTALL_HINT} ({e.name} is missing)") from None
        if processor is None:
            if not endpoint:
                raise ValueError("RequestTracer needs an OTLP endpoint or a span processor")
            try:
                from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
                from opentelemetry.sdk.trace.export import BatchSpanProcessor
            except ImportError as e:
                raise RuntimeError(f"{INSTALL_HINT} ({e.name} is missing)") from None
            processor = BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint))
        self.provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        self.provider.add_span_processor(processor)
        self.tracer = self.provider.get_tracer("llmsvc")
        self._propagator = TraceContextTextMapPropagator()
        self._getter = DefaultGetter()
        self._kind, self._status, self._code = SpanKind.SERVER, Status, StatusCode
        self.endpoint = endpoint

    def record(self, *, request_id: str, metadata, start_ns: int, end_ns: int, code: grpc.StatusCode,
               model: str, params=None, prompt_tokens: int | None = None, tracker=None,
               message: str = "") -> None:
        """Write the span of one finished call. `params`: its SamplingParams (None when it
        failed validation); `tracker`: its metrics.RequestTracker (completions and times)."""
        carrier = {k: v for k, v in (metadata or ()) if k in ("traceparent", "tracestate")}
        parent = self._propagator.extract(carrier, getter=self._getter)
        attrs: dict[str, Any] = {"gen_ai.request.id": request_id, "gen_ai.response.model": model,
                                 "rpc.system": "grpc", "rpc.service": "llmsvc.v1.LlmService",
                                 "rpc.method": "Generate", "rpc.grpc.status_code": code.value[0]}
        if params is not None:
            attrs.update({"gen_ai.request.temperature": params.temperature, "gen_ai.request.top_p": params.top_p,
                          "gen_ai.request.n": params.n})
            if params.max_tokens is not None:
                attrs["gen_ai.request.max_tokens"] = params.max_tokens
        if prompt_tokens is not None:
            attrs["gen_ai.usage.prompt_tokens"] = prompt_tokens
        if tracker is not None:
            attrs.update(_tracker_attributes(tracker))
        span = self.tracer.start_span(SPAN_NAME, context=parent, kind=self._kind, attributes=attrs,
                                      start_time=start_ns)
        if code not in (grpc.StatusCode.OK, grpc.StatusCode.CANCELLED):
            span.set_status(self._status(self._code.ERROR, f"{code.name}: {message}" if message else code.name))
        span.end(end_time=end_ns)

    def shutdown(self) -> None:
        """Flush what is queued to the exporter, then stop it."""
        try:
            self.provider.shutdown()
        except Exception:  # noqa: BLE001 - a collector that went away must not fail the shutdown
            logger.warning("tracing: flushing spans failed", exc_info=True)


def _tracker_attributes(tracker) -> dict[str, Any]:
    attrs: dict[str, Any] = {"gen_ai.usage.completion_tokens": tracker.num_generated}
    if tracker.reasons:
        attrs["gen_ai.response.finish_reasons"] = [tracker.reasons[i] for i in sorted(tracker.reasons)]
    final = tracker.final
    if final is None:
        return attrs
    attrs["gen_ai.usage.cached_tokens"] = final.num_cached_tokens
    rm = final.metrics
    if rm is not None:
        for name, t in (("time_in_queue", rm.first_scheduled_time), ("time_to_first_token", rm.first_token_time),
                        ("e2e", rm.finished_time)):
            if t is not None:
                attrs[f"gen_ai.latency.{name}"] = max(0.0, t - rm.arrival_time)
        attrs["llmsvc.num_preemptions"] = rm.num_preemptions
    return attrs
