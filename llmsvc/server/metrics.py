"""Prometheus metrics for one LlmServer: own registry, HTTP endpoint on --metrics-port at /metrics.

Series (all `llmsvc_`):
- per RPC (interceptor): grpc_requests_total{service, method, code}
- per request (servicer, from RequestOutput.metrics, wall-clock seconds):
  request_success_total{finish_reason} (one per completion of a request the engine took; a
  cancelled call counts "abort", a refused one nothing), time_to_first_token_seconds (at the
  first token, so calls cancelled afterwards count too), time_per_output_token_seconds, e2e_request_latency_seconds,
  request_queue_time_seconds, request_prefill_time_seconds (first scheduled to first token),
  request_decode_time_seconds (first token to last), request_prompt_tokens,
  request_generation_tokens (histograms); prompt_tokens_total (a request's whole prompt once it
  has output, cache hits included) and generation_tokens_total (output tokens delivered), as
  vLLM counts them.
  These also carry one Prometheus label per allow-listed GenerateRequest.labels key
  (`label_keys`, the --metrics-label-keys flag): "" when a request lacks it, and "other" once a
  key has seen MAX_LABEL_VALUES distinct values, so the number of series stays bounded. The key
  `lora_name` is the request's LoRA adapter ("" for the base model), whatever its labels say.
- engine (engine_metrics.py, sampled on scrape from AsyncEngine.get_stats(), which never blocks on the engine
  thread): num_requests_running / num_requests_waiting / kv_cache_usage_perc (0..1) /
  prefix_cache_hit_rate (0..1, since start) / num_kv_blocks / num_free_kv_blocks gauges;
  prompt_tokens_computed_total, num_preemptions_total, prefix_cache_queries_total
  and prefix_cache_hits_total (prompt tokens looked up / found; rate() of their ratio is the hit
  rate over any window, as vLLM's) counters; server_ready, server_draining, engine_healthy gauges.
  With speculative decoding: spec_decode_num_drafts_total, spec_decode_num_draft_tokens_total,
  spec_decode_num_accepted_tokens_total and spec_decode_num_accepted_tokens_per_pos_total{position}
  counters (vLLM's names), so rate(accepted) / rate(draft tokens) is the acceptance rate.
  With a swap space (--swap-space): num_requests_swapped gauge; num_swap_outs_total,
  num_swap_ins_total, blocks_swapped_out_total, blocks_swapped_in_total and host_tier_hits_total
  counters (engine_metrics.SWAP_COUNTERS).
"""
from __future__ import annotations

import logging
import re
from typing import Callable, Iterable

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram

from llmsvc.outputs import ABORT, RequestOutput
from llmsvc.server.engine_metrics import EngineCollector, EngineSnapshot
from llmsvc.server.rpc_wrap import wrap_handler

logger = logging.getLogger(__name__)

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0,
                   640.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5,
                5.0)
TOKEN_BUCKETS = tuple(2 ** i for i in range(18))  # 1 .. 131072
MAX_LABEL_VALUES = 100  # distinct values kept per allow-listed label key; later ones count as "other"
OTHER = "other"
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
_RESERVED_LABELS = {"finish_reason", "service", "method", "code", "le", "quantile"}


def parse_label_keys(text: str | Iterable[str] | None) -> tuple[str, ...]:
    """'tenant,team' -> ('tenant', 'team'); ValueError for a key Prometheus cannot carry as a label."""
    keys = [k.strip() for k in (text.split(",") if isinstance(text, str) else text or ()) if k.strip()]
    for k in keys:
        if not _LABEL_NAME.fullmatch(k) or k.startswith("__") or k in _RESERVED_LABELS:
            raise ValueError(f"metrics label key {k!r} is not usable as a Prometheus label "
                             f"([a-zA-Z_][a-zA-Z0-9_]*, not {sorted(_RESERVED_LABELS)})")
    if len(set(keys)) != len(keys):
        raise ValueError(f"metrics label keys repeat: {keys}")
    return tuple(keys)


class ServerMetrics:
    """Every series of one server instance, in `self.registry` (never the global one)."""

    def __init__(self, registry: CollectorRegistry | None = None, label_keys: Iterable[str] = ()) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self.label_keys = parse_label_keys(label_keys)
        self._seen_values: dict[str, set[str]] = {k: set() for k in self.label_keys}
        r, keys = self.registry, list(self.label_keys)
        self.grpc_requests = Counter("llmsvc_grpc_requests", "RPCs finished, by method and gRPC status code",
                                     ["service", "method", "code"], registry=r)
        self.request_success = Counter("llmsvc_request_success", "Completions finished, by finish reason",
                                       ["finish_reason"] + keys, registry=r)

        def histogram(name, doc, buckets):
            return Histogram(name, doc, keys, buckets=buckets, registry=r)
        self.ttft = histogram("llmsvc_time_to_first_token_seconds", "Arrival to first output token", LATENCY_BUCKETS)
        self.tpot = histogram("llmsvc_time_per_output_token_seconds",
                              "Mean time between output tokens of a request (after the first)", TPOT_BUCKETS)
        self.e2e = histogram("llmsvc_e2e_request_latency_seconds", "Arrival to finish", LATENCY_BUCKETS)
        self.queue = histogram("llmsvc_request_queue_time_seconds", "Arrival to first scheduled", LATENCY_BUCKETS)
        self.prefill = histogram("llmsvc_request_prefill_time_seconds", "First scheduled to first output token",
                                 LATENCY_BUCKETS)
        self.decode = histogram("llmsvc_request_decode_time_seconds", "First output token to the last",
                                LATENCY_BUCKETS)
        # Counted as clients see them (vLLM's prompt_tokens / generation_tokens): every prompt token
        # of a request once it has output (prefix-cache hits included), every token delivered
        # (not those the engine made past a stop string before the abort reached it).
        self.prompt_tokens_total = Counter("llmsvc_prompt_tokens", "Prompt tokens of requests that started output "
                                           "(prefix-cache hits included)", keys, registry=r)
        self.generation_tokens_total = Counter("llmsvc_generation_tokens", "Output tokens delivered", keys,
                                               registry=r)
        self.prompt_tokens = histogram("llmsvc_request_prompt_tokens", "Prompt tokens per request", TOKEN_BUCKETS)
        self.generation_tokens = histogram("llmsvc_request_generation_tokens",
                                           "Generated tokens per request (all completions)", TOKEN_BUCKETS)

    def label_values(self, labels: dict[str, str] | None) -> tuple[str, ...]:
        """The allow-listed keys' values of a request's labels (bounded per key, see the module doc)."""
        out = []
        for k in self.label_keys:
            v = (labels or {}).get(k, "")
            seen = self._seen_values[k]
            if v and v not in seen:
                if len(seen) >= MAX_LABEL_VALUES:
                    v = OTHER
                else:
                    seen.add(v)
            out.append(v)
        return tuple(out)

    def track(self, n: int = 1, labels: dict[str, str] | None = None) -> "RequestTracker":
        """A tracker for one Generate call producing `n` completions, labelled by `labels`' allow-listed keys."""
        return RequestTracker(self, n, self.label_values(labels))

    def add_engine_collector(self, source: Callable[[], "EngineSnapshot"]) -> None:
        self.registry.register(EngineCollector(source))

    def interceptor(self) -> "MetricsInterceptor":
        return MetricsInterceptor(self)


class RequestTracker:
    """Fed every (delta) RequestOutput of one request; records each series exactly once."""

    def __init__(self, metrics: ServerMetrics, n: int, label_values: tuple[str, ...] = ()) -> None:
        self.m = metrics
        self.n = n
        self.label_values = label_values
        self.reasons: dict[int, str] = {}  # completion index -> finish reason
        self.tokens: dict[int, int] = {}  # completion index -> output tokens so far (cumulative)
        self.done = False
        self.admitted = False  # the engine took the request (set by the servicer)
        self.started = False  # the first output token arrived (its prompt is counted)
        self.final: RequestOutput | None = None  # the output that finished the request

    def observe(self, out: RequestOutput) -> None:
        if self.done:
            return
        if not self.started and any(c.num_output_tokens for c in out.outputs):
            self.started = True
            self._series(self.m.prompt_tokens_total).inc(len(out.prompt_token_ids))
            rm = out.metrics  # at the first token, as vLLM: a call cancelled later still counts
            if rm is not None and rm.first_token_time is not None:
                self._series(self.m.ttft).observe(max(0.0, rm.first_token_time - rm.arrival_time))
        for comp in out.outputs:
            before = self.tokens.get(comp.index, 0)
            if comp.num_output_tokens > before:
                self.tokens[comp.index] = comp.num_output_tokens
                self._series(self.m.generation_tokens_total).inc(comp.num_output_tokens - before)
            if comp.finish_reason is not None and comp.index not in self.reasons:
                self.reasons[comp.index] = comp.finish_reason
                self.m.request_success.labels(comp.finish_reason, *self.label_values).inc()
        if out.finished:
            self.done, self.final = True, out
            self._observe_final(out)

    @property
    def num_generated(self) -> int:
        return sum(self.tokens.values())

    def cancelled(self) -> None:
        """The call ended before the final output (client cancel, deadline, a failure after
        admission): the rest were aborted. A request the engine never took (refused: queue
        full, duplicate id, draining) finished nothing and counts no completion."""
        if self.done or not self.admitted:
            return
        self.done = True
        for i in range(self.n):
            if i not in self.reasons:
                self.reasons[i] = ABORT
                self.m.request_success.labels(ABORT, *self.label_values).inc()

    def _series(self, metric):
        """`metric`'s series for this request's label values (the metric itself without keys)."""
        return metric.labels(*self.label_values) if self.label_values else metric

    def _observe_final(self, out: RequestOutput) -> None:
        m, series = self.m, self._series
        series(m.prompt_tokens).observe(len(out.prompt_token_ids))
        num_out = max(self.tokens.values(), default=0)  # the longest completion paces the request
        series(m.generation_tokens).observe(self.num_generated)
        rm = out.metrics
        if rm is None:
            return
        if rm.first_scheduled_time is not None:
            series(m.queue).observe(max(0.0, rm.first_scheduled_time - rm.arrival_time))
        if rm.first_token_time is not None:
            if rm.first_scheduled_time is not None:
                series(m.prefill).observe(max(0.0, rm.first_token_time - rm.first_scheduled_time))
            if rm.last_token_time is not None:
                decode = max(0.0, rm.last_token_time - rm.first_token_time)
                series(m.decode).observe(decode)
                if num_out > 1:
                    series(m.tpot).observe(decode / (num_out - 1))
        if rm.finished_time is not None:
            series(m.e2e).observe(max(0.0, rm.finished_time - rm.arrival_time))


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
