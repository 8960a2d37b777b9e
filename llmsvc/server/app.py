"""Build, start, load, serve and gracefully stop the grpc.aio server.

Lifecycle: start() binds the port and serves health ("" SERVING, LlmService NOT_SERVING) and
reflection at once; load() builds the engine in a worker thread, warms it up, then flips
LlmService to SERVING. shutdown(grace): NOT_SERVING -> new Generate UNAVAILABLE -> in-flight
requests get `grace` seconds -> the rest are aborted -> the server stops (metrics endpoint last).
Options: TLS/mTLS (`tls`), bearer-token auth (`auth_tokens`; health and reflection stay open),
admin tokens (`admin_tokens`: without them AdminService answers PERMISSION_DENIED), a span per
Generate call to OpenTelemetry (`tracer`, tracing.py),
Prometheus metrics on their own HTTP port (`metrics_port`: None = off, 0 = any free port), with
the GenerateRequest.labels keys in `metrics_label_keys` as Prometheus labels, and vLLM's engine
protocol beside llmsvc.v1 (`vllm_engine`, on by default: llmsvc.server.vllm_engine), in health and
reflection too.
"""
from __future__ import annotations

import asyncio
import logging
from concurrent.futures import Future
from typing import Callable

import grpc

from llmsvc.engine.async_engine import AsyncEngine
from llmsvc.engine_request import EngineRequest
from llmsvc.outputs import EngineStats
from llmsvc.sampling_params import SamplingParams
from llmsvc.server.admin import AdminService
from llmsvc.server.auth import ADMIN_PREFIXES, BearerTokenInterceptor
from llmsvc.server.health import Health, add_reflection
from llmsvc.server.engine_metrics import EngineSnapshot
from llmsvc.server.metrics import MetricsHttpServer, ServerMetrics
from llmsvc.server.rpc_wrap import DecodeGuardInterceptor
from llmsvc.server.servicer import LlmService, ServerState
from llmsvc.server.tls import TlsConfig
from llmsvc.server.vllm_engine import SERVICE_NAME as VLLM_ENGINE_SERVICE, VllmEngineService, add_to_server
from llmsvc.v1 import llmsvc_pb2_grpc as pb_grpc

logger = logging.getLogger("llmsvc.server")
_HEALTH_FLUSH_S = 0.5  # after the engine dies, how long Health.Watch streams get to send NOT_SERVING

SERVER_OPTIONS = (
    ("grpc.max_receive_message_length", 64 << 20),  # long token-id prompts
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.http2.max_ping_strikes", 0),  # never GOAWAY a client for pinging
    ("grpc.keepalive_permit_without_calls", 1),
    # gRPC sets SO_REUSEPORT by default: a second server on a busy port would bind and silently
    # share it with the first. Off, the bind fails and the second server exits.
    ("grpc.so_reuseport", 0),
)


class BindError(OSError):
    """The gRPC or metrics port could not be bound (in use, or not an address of this machine)."""


def default_engine_factory(config, core_start: Future | None = None) -> Callable[[], object]:
    """`core_start`: a future of llm_engine.start_engine_core(config), begun before the server
    was built so the engine-core process loads the model while this process starts up."""
    def make():
        from llmsvc.engine.llm_engine import LLMEngine  # heavy: model loading
        if core_start is not None:
            resolved, client = core_start.result()
            return LLMEngine.from_config(resolved, core_client=client)
        return LLMEngine.from_config(config)
    return make


class LlmServer:
    def __init__(self, engine_factory: Callable[[], object], *, host: str = "127.0.0.1", port: int = 0,
                 max_backlog_bytes: int = 4 << 20, max_backlog_age_s: float = 60.0,
                 max_waiting_requests: int | None = None, warmup: bool = True,
                 tls: TlsConfig | None = None, auth_tokens: list[str] | None = None,
                 admin_tokens: list[str] | None = None, tracer=None,
                 metrics_port: int | None = None, metrics_host: str | None = None,
                 metrics_label_keys: tuple[str, ...] = (), log_requests: bool = True,
                 vllm_engine: bool = True) -> None:
        self.engine_factory = engine_factory
        self.host, self.port = host, port
        self.backlog = dict(max_backlog_bytes=max_backlog_bytes, max_backlog_age_s=max_backlog_age_s)
        self.max_waiting_requests = max_waiting_requests
        self.warmup = warmup
        self._counters_from: EngineStats | None = None  # engine totals once warmed up (metrics start there)
        self.shutdown_grace = 30.0  # seconds in-flight requests get when serve() is stopped
        self._signal_grace: float | None = None  # shutdown_grace before a Drain RPC replaced it
        self.state = ServerState()
        # vLLM's engine protocol beside llmsvc.v1 (vllm_engine=False: llmsvc.v1 alone)
        self.vllm = VllmEngineService(self.state) if vllm_engine else None
        self._extra_services = (VLLM_ENGINE_SERVICE,) if vllm_engine else ()
        self.health = Health(self._extra_services)
        self.tls = tls
        self.auth = BearerTokenInterceptor(auth_tokens) if auth_tokens else None
        self.admin_auth = (BearerTokenInterceptor(admin_tokens, guarded_prefixes=ADMIN_PREFIXES)
                           if admin_tokens else None)
        self.admin = AdminService(bool(admin_tokens), self.begin_drain, lambda: self.async_engine)
        self.metrics = ServerMetrics(label_keys=metrics_label_keys)
        self.metrics.add_engine_collector(self._engine_snapshot)
        self.metrics_http = (MetricsHttpServer(self.metrics.registry, metrics_host or host, metrics_port)
                             if metrics_port is not None else None)
        self.servicer = LlmService(self.state)
        self.servicer.log_requests = log_requests
        self.servicer.metrics = self.metrics
        self.tracer = self.servicer.tracer = tracer  # tracing.RequestTracer or None
        if self.vllm is not None:
            self.vllm.metrics = self.metrics
            self.vllm.log_requests = log_requests
        self.server: grpc.aio.Server | None = None
        self.async_engine: AsyncEngine | None = None
        self.engine_died = False
        self._watch: asyncio.Task | None = None
        self._stopping: asyncio.Future | None = None  # the one shutdown, however it began
        self._grace_cut = False  # end_grace(): a second stop signal
        self._drain_begun: asyncio.Event | None = None  # set by begin_drain(); made in start()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def metrics_port(self) -> int | None:
        return self.metrics_http.port if self.metrics_http is not None else None

    def _engine_snapshot(self) -> EngineSnapshot:
        """Called on the metrics HTTP thread: plain attribute reads only."""
        ae = self.async_engine
        return EngineSnapshot(ae.get_stats() if ae is not None else None, self.state.ready, self.state.draining,
                              ae.is_healthy if ae is not None else False, self._counters_from)

    async def start(self) -> int:
        """Bind and serve health + reflection (+ LlmService answering UNAVAILABLE). Returns the port."""
        interceptors = ([self.metrics.interceptor()] + [a for a in (self.auth, self.admin_auth) if a is not None]
                        + [DecodeGuardInterceptor()])
        self._drain_begun = asyncio.Event()
        self.server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=interceptors)
        pb_grpc.add_LlmServiceServicer_to_server(self.servicer, self.server)
        pb_grpc.add_AdminServiceServicer_to_server(self.admin, self.server)
        if self.vllm is not None:
            add_to_server(self.vllm, self.server)
        self.health.add_to_server(self.server)
        add_reflection(self.server, self._extra_services)
        host = f"[{self.host}]" if ":" in self.host else self.host
        address = f"{host}:{self.port}"
        try:
            if self.tls is not None:
                bound = self.server.add_secure_port(address, self.tls.server_credentials())
            else:
                bound = self.server.add_insecure_port(address)
        except RuntimeError:  # grpc: "Failed to bind to address ..."
            bound = 0
        if not bound:
            await self.server.stop(None)
            self.server = None
            raise BindError(f"cannot listen on {address}: port {self.port} is already in use "
                            f"or {self.host} is not an address of this machine")
        self.port = bound
        await self.server.start()
        await self.health.starting()
        if self.metrics_http is not None:
            try:
                self.metrics_http.start()
            except OSError as e:  # in use, or not an address of this machine
                await self.server.stop(None)
                self.server = None
                raise BindError(f"cannot listen for metrics on {self.metrics_http.host}:{self.metrics_http.port}: "
                                f"{e.strerror or e}") from None
            logger.info("metrics on http://%s:%d/metrics", self.metrics_http.host, self.metrics_http.port)
        mode = "mTLS" if self.tls and self.tls.mutual else "TLS" if self.tls else "plaintext"
        logger.info("listening on %s (%s%s%s)", self.address, mode, ", bearer-token auth" if self.auth else "",
                    ", admin RPCs on" if self.admin_auth else "")
        return self.port

    async def load(self) -> None:
        """Build the engine off the event loop, warm it up, then report SERVING."""
        engine = await asyncio.to_thread(self.engine_factory)
        ae = AsyncEngine(engine, max_waiting_requests=self.max_waiting_requests, **self.backlog)
        await ae.start()
        self.async_engine = ae
        config = engine.config
        self.state.device = config.device  # resolved by the engine ("auto" never reaches here)
        if self.warmup:
            await self._warm_up(ae, config)
            self._counters_from = ae.get_stats()  # the warm-up's tokens are not the clients'
        self.servicer.attach(ae, engine.tokenizer, config)
        if self.vllm is not None:
            await self.vllm.attach(ae, engine.tokenizer, config)
        self.state.ready = True
        await self.health.ready()
        self._watch = asyncio.create_task(self._watch_engine(ae))
        logger.info("ready: serving %s on %s", config.model_config.served_model_name, self.address)

    @staticmethod
    async def _warm_up(ae: AsyncEngine, config) -> None:
        mc = config.model_config
        tok = next((t for t in (mc.bos_token_id, *(mc.eos_token_ids or [])) if t is not None), 0)
        warmup = EngineRequest("llmsvc-warmup", [tok], SamplingParams(max_tokens=1, temperature=0.0))
        async for _ in ae.generate(warmup):
            pass

    async def _watch_engine(self, ae: AsyncEngine) -> None:
        exc = await ae.wait_dead()
        self.engine_died = True
        logger.error("engine loop died (%s: %s); reporting NOT_SERVING", type(exc).__name__, exc)
        await self.health.not_serving()
        # serve() stops the server when this returns: first let open Health.Watch streams send
        # NOT_SERVING (a stop right away could cancel them before the update is written, and a
        # watcher would see the stream end without knowing why)
        await asyncio.sleep(_HEALTH_FLUSH_S)

    async def serve(self, stop: asyncio.Event) -> int:
        """start + load, then run until `stop` is set or the engine dies. Returns an exit code."""
        await self.start()
        try:
            load = asyncio.create_task(self.load())
            stopper = asyncio.create_task(stop.wait())
            drained = asyncio.create_task(self._drain_begun.wait())  # the Drain RPC
            await asyncio.wait({load, stopper, drained}, return_when=asyncio.FIRST_COMPLETED)
            if not load.done():
                load.cancel()
                await asyncio.gather(load, return_exceptions=True)
            else:
                load.result()  # a failed load raises: exit non-zero
                await asyncio.wait({self._watch, stopper, drained}, return_when=asyncio.FIRST_COMPLETED)
            stopper.cancel()
            drained.cancel()
        finally:  # after a Drain RPC this waits for the shutdown it began
            await self.shutdown(grace=0.0 if self.engine_died else self.shutdown_grace)
        return 1 if self.engine_died else 0

    def begin_drain(self, grace: float | None = None) -> tuple[bool, float]:
        """The Drain RPC: shutdown(grace) in the background, as a stop signal would (serve()
        then returns 0 once it ends). grace None: shutdown_grace. Returns (already draining,
        the grace in force)."""
        if self._stopping is not None:
            return True, self.shutdown_grace
        if grace is not None:
            self._signal_grace, self.shutdown_grace = self.shutdown_grace, grace
        self._stopping = asyncio.ensure_future(self._shutdown(self.shutdown_grace))
        self._drain_begun.set()
        return False, self.shutdown_grace

    def stop_signal(self) -> None:
        """A first stop signal during a Drain RPC's grace: in-flight requests get at most the
        server's own shutdown grace from now, so a supervisor's stop timeout sized to it holds."""
        if self._signal_grace is None or self._signal_grace >= self.shutdown_grace:
            return
        logger.warning("stop signal while draining: in-flight requests get at most %.1f s more",
                       self._signal_grace)
        if self.async_engine is not None:
            self.async_engine.cap_grace(self._signal_grace)

    def end_grace(self) -> None:
        """A second stop signal: abort in-flight requests now instead of waiting out the grace."""
        self._grace_cut = True
        if self.async_engine is not None:
            self.async_engine.end_grace()

    async def shutdown(self, grace: float = 30.0) -> None:
        """Drain: NOT_SERVING, refuse new requests, let in-flight finish for `grace` s, stop.
        Once begun (here or by begin_drain) a later call waits for that shutdown to end."""
        if self._stopping is None:
            self._stopping = asyncio.ensure_future(self._shutdown(grace))
        await asyncio.shield(self._stopping)

    async def _shutdown(self, grace: float) -> None:
        self.state.draining = True
        await self.health.draining()
        if self.vllm is not None:  # a gateway reads the end of its KV-event stream as "route elsewhere"
            await self.vllm.close("the server is draining")
        logger.info("draining (grace %.1f s)", grace)
        if self.async_engine is not None:
            if self._grace_cut:
                self.async_engine.end_grace()
            await self.async_engine.shutdown(grace)
        if self._watch is not None:
            self._watch.cancel()
        if self.server is not None:
            await self.server.stop(1.0)
        if self.metrics_http is not None:
            self.metrics_http.stop()
        if self.tracer is not None:
            await asyncio.to_thread(self.tracer.shutdown)  # the last spans reach the collector
        logger.info("stopped")
