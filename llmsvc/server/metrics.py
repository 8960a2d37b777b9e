"""Prometheus metrics for one LlmServer: own registry, HTTP endpoint on --metrics-port at /metrics.

Series (all `llmsvc_`):
- per RPC (interceptor): grpc_requests_total{service, method, code}
- per request (servicer, from RequestOutput.metrics, wall-clock seconds):
  request_success_total{finish_reason} (one per completion; a cancelled call counts "abort"),
  time_to_first_token_seconds, time_per_output_token_seconds, e2e_request_latency_seconds,
  request_queue_time_seconds, request_prompt_tokens, request_generation_tokens (histograms)
- engine (sampled on scrape from AsyncEngine.get_stats(), which never blocks on the engine
  thread): num_requests_running / num_requests_waiting / kv_cache_usage_perc (0..1) /
  prefix_cache_hit_rate (0..1) / num_kv_blocks / num_free_kv_blocks gauges; prompt_tokens_total,
  generation_tokens_total, num_preemptions_total counters; server_ready, server_draining,
  engine_healthy gauges.
"""
from __future__ import annotations

import logging
from typing import Callable

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from llmsvc.outputs import ABORT, EngineStats, RequestOutput
from llmsvc.server.rpc_wrap import wrap_handler

logger = logging.getLogger(__name__)

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0,
                   640.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5,
                5.0)
TOKEN_BUCKETS = tuple(2 ** i for i in range(18))  # 1 .. 131072


class ServerMetrics:
    """Every series of one server instance, in `self.registry` (never the global one)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        r = self.registry
        self.grpc_requests = Counter("llmsvc_grpc_requests", "RPCs finished, by method and gRPC status code",
                                     ["service", "method", "code"], registry=r)
        self.request_success = Counter("llmsvc_request_success", "Completions finished, by finish reason",
                                       ["finish_reason"], registry=r)
        self.ttft = Histogram("llmsvc_time_to_first_token_seconds", "Arrival to first output token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("llmsvc_time_per_output_token_seconds",
                              "Mean time between output tokens of a request (after the first)",
                              buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("llmsvc_e2e_request_latency_seconds", "Arrival to finish",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.queue = Histogram("llmsvc_request_queue_time_seconds", "Arrival to first scheduled",
                               buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Histogram("llmsvc_request_prompt_tokens", "Prompt tokens per request",
                                       buckets=TOKEN_BUCKETS, registry=r)
        self.generation_tokens = Histogram("llmsvc_request_generation_tokens",
                                           "Generated tokens per request (all completions)",
                                           buckets=TOKEN_BUCKETS, registry=r)

    def track(self, n: int = 1) -> "RequestTracker":
        """A tracker for one Generate call producing `n` completions."""
        return RequestTracker(self, n)

    def add_engine_collector(self, source: Callable[[], "EngineSnapshot"]) -> None:
        self.registry.register(EngineCollector(source))

    def interceptor(self) -> "MetricsInterceptor":
        return MetricsInterceptor(self)


class RequestTracker:
    """Fed every (delta) RequestOutput of one request; records each series exactly once."""

    def __init__(self, metrics: ServerMetrics, n: int) -> None:
        self.m = metrics
        self.n = n
        self.reasons: dict[int, str] = {}  # completion index -> finish reason
        self.tokens: dict[int, int] = {}  # completion index -> output tokens so far (cumulative)
        self.done = False

    def observe(self, out: RequestOutput) -> None:
        if self.done:
            return
        for comp in out.outputs:
            self.tokens[comp.index] = max(self.tokens.get(comp.index, 0), comp.num_output_tokens)
            if comp.finish_reason is not None and comp.index not in self.reasons:
                self.reasons[comp.index] = comp.finish_reason
                self.m.request_success.labels(comp.finish_reason).inc()
        if out.finished:
            self.done = True
            self._observe_final(out)

    @property
    def num_generated(self) -> int:
        return sum(self.tokens.values())

    def cancelled(self) -> None:
        """The call ended before the final output (client cancel, deadline): the rest were aborted."""
        if self.done:
            return
        self.done = True
        for i in range(self.n):
            if i not in self.reasons:
                self.reasons[i] = ABORT
                self.m.request_success.labels(ABORT).inc()

    def _observe_final(self, out: RequestOutput) -> None:
        m = self.m
        m.prompt_tokens.observe(len(out.prompt_token_ids))
        num_out = max(self.tokens.values(), default=0)  # the longest completion paces the request
        m.generation_tokens.observe(self.num_generated)
        rm = out.metrics
        if rm is None:
            return
        if rm.first_scheduled_time is not None:
            m.queue.observe(max(0.0, rm.first_scheduled_time - rm.arrival_time))
        if rm.first_token_time is not None:
            m.ttft.observe(max(0.0, rm.first_token_time - rm.arrival_time))
            if rm.last_token_time is not None and num_out > 1:
                m.tpot.observe(max(0.0, rm.last_token_time - rm.first_token_time) / (num_out - 1))
        if rm.finished_time is not None:
            m.e2e.observe(max(0.0, rm.finished_time - rm.arrival_time))


class EngineSnapshot:
    """What the engine collector reads at scrape time (plain values; no engine call)."""

    def __init__(self, stats: EngineStats | None = None, ready: bool = False, draining: bool = False,
                 healthy: bool = False) -> None:
        self.stats = stats if stats is not None else EngineStats()
        self.ready, self.draining, self.healthy = ready, draining, healthy


class EngineCollector(Collector):
    """Engine gauges and counters, sampled on each scrape from `source()`."""

    def __init__(self, source: Callable[[], EngineSnapshot]) -> None:
        self.source = source

    def describe(self):
        return list(self._families(EngineSnapshot()))

    def collect(self):
        try:
            snap = self.source()
        except Exception:  # noqa: BLE001 - a scrape never fails because of the engine
            logger.exception("engine metrics sampling failed")
            snap = EngineSnapshot()
        return list(self._families(snap))

    @staticmethod
    def _families(snap: EngineSnapshot):
        s = snap.stats
        gauges = (("num_requests_running", "Requests running in the engine", s.num_running),
                  ("num_requests_waiting", "Requests waiting to be scheduled", s.num_waiting),
                  ("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0..1)", s.kv_cache_usage),
                  ("prefix_cache_hit_rate", "Prompt tokens served from the prefix cache (0..1)",
                   s.prefix_cache_hit_rate),
                  ("num_kv_blocks", "KV cache blocks in total", s.num_kv_blocks),
                  ("num_free_kv_blocks", "KV cache blocks free", s.num_free_kv_blocks),
                  ("server_ready", "1 once the model is loaded and warmed up", int(snap.ready)),
                  ("server_draining", "1 while shutting down", int(snap.draining)),
                  ("engine_healthy", "1 while the engine loop runs", int(snap.healthy)))
        for name, doc, value in gauges:
            yield GaugeMetricFamily("llmsvc_" + name, doc, value=float(value))
        counters = (("prompt_tokens", "Prompt tokens processed", s.prompt_tokens_total),
                    ("generation_tokens", "Tokens generated", s.generation_tokens_total),
                    ("num_preemptions", "Requests preempted (KV cache full)", s.num_preemptions))
        for name, doc, value in counters:
            yield CounterMetricFamily("llmsvc_" + name, doc, value=float(value))


class MetricsInterceptor(grpc.aio.ServerInterceptor):
    """Counts every finished RPC by service, method and final status code."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        service, _, method = handler_call_details.method.lstrip("/").rpartition("/")
        counter = self.metrics.grpc_requests

        def on_done(code: grpc.StatusCode, _seconds: float) -> None:
            counter.labels(service, method, code.name).inc()
        return wrap_handler(handler, on_done)


class MetricsHttpServer:
    """prometheus_client's HTTP server for one registry, in a daemon thread: GET /metrics."""

    def __init__(self, registry: CollectorRegistry, host: str = "0.0.0.0", port: int = 0) -> None:
        self.registry, self.host, self.port = registry, host, port
        self._httpd = self._thread = None

    def start(self) -> int:
        from prometheus_client import start_http_server
        self._httpd, self._thread = start_http_server(self.port, addr=self.host, registry=self.registry)
        self.port = self._httpd.server_port
        return self.port

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._thread.join(5.0)
            self._httpd = self._thread = None
