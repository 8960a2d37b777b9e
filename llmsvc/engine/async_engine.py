"""AsyncEngine: an LLMEngine driven by ONE dedicated thread, consumed from asyncio. Torch-free.

Threads and ownership:
- The engine thread is the only caller of the wrapped engine (add_request, abort_request,
  step, get_stats, shutdown). It sleeps on a condition variable when there is nothing to do.
- The event loop owns the per-request `RequestStream`s. Adds and aborts from asyncio are
  queued as commands to the engine thread; each step's outputs come back in one
  `loop.call_soon_threadsafe` callback and are merged into the streams (coalescing).
- A request id is reserved from `generate()` until the engine reports the request finished
  (normally or by abort), so a cancelled id cannot be reused while its KV blocks still exist.

If the engine thread dies (step raised, or the idle-time `engine.check_health()` raised: a
worker process died while nothing ran), every in-flight stream raises EngineDeadError
(EngineStepError when the cause was not a worker failure), `is_healthy` turns False and new
requests are refused.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from typing import AsyncIterator, Awaitable, Callable

from llmsvc.core.burst import IDLE_HEALTH_CHECK_S
from llmsvc.core.errors import QueueFullError
from llmsvc.engine.commands import AbortRequests, AddRequest, Command
from llmsvc.engine.constraint_wait import submit_constraint, wait_compiled
from llmsvc.engine.engine_calls import EngineCallsMixin
from llmsvc.engine.engine_thread import EngineThreadMixin
from llmsvc.engine.errors import (  # noqa: F401 - importable from here too, as the servicer does
    AsyncEngineError, EngineDeadError, EngineStepError, EngineStoppedError, OutputBacklogError, is_worker_failure)
from llmsvc.engine.output_stream import RequestStream
from llmsvc.engine.request_ids import RequestIds, check_free
from llmsvc.outputs import EngineStats, RequestOutput
from llmsvc.engine_request import EngineRequest
from llmsvc.sampling_params import RequestOutputKind
from llmsvc.structured.errors import ConstraintError

logger = logging.getLogger(__name__)


class AsyncEngine(EngineThreadMixin, EngineCallsMixin):
    def __init__(self, engine, *, max_waiting_requests: int | None = None,
                 max_backlog_bytes: int = 4 << 20, max_backlog_age_s: float = 60.0) -> None:
        self.engine = engine
        if max_waiting_requests is None:
            max_waiting_requests = engine.config.scheduler_config.max_waiting_requests
        # the one admission cap (the engine has none: offline generate queues any number of
        # prompts); checked here, so a full queue is refused at once, even during a long step
        self.max_waiting_requests = max_waiting_requests
        self.max_num_seqs = engine.config.scheduler_config.max_num_seqs
        self.max_backlog_bytes = max_backlog_bytes
        self.max_backlog_age_s = max_backlog_age_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._cond = threading.Condition()
        self._commands: deque[Command] = deque()
        self._stop = False
        self._streams: dict[str, RequestStream] = {}  # event-loop side
        self._ids = RequestIds()  # the streams' ids and their samples' (request_ids.py)
        self._num_seqs = 0  # sum of the streams' n: the sequences they are in the engine
        self._stats = EngineStats()
        self._dead: BaseException | None = None
        self._accepting = True
        self._grace_end = float("inf")  # monotonic time shutdown() stops waiting (end_grace, cap_grace lower it)
        self._dead_event: asyncio.Event | None = None
        self._kv_listener: Callable | None = None  # follow_kv_events'; called on the loop
        self._kv_cursor = 0  # the engine thread's: the last KV event handed to it
        self.health_check_interval_s = IDLE_HEALTH_CHECK_S  # idle engine thread polls engine.check_health()

    # ---- lifecycle -------------------------------------------------------------------
    async def start(self) -> None:
        """Bind to the running loop and start the engine thread."""
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._dead_event = asyncio.Event()
        self._thread = threading.Thread(target=self._run, name="llmsvc-engine", daemon=True)
        self._thread.start()

    @property
    def is_healthy(self) -> bool:
        return self._dead is None and self._thread is not None and self._thread.is_alive()

    @property
    def dead_error(self) -> BaseException | None:
        return self._dead

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    async def wait_dead(self) -> BaseException:
        """Return (the engine's exception) once the engine loop has died."""
        await self._dead_event.wait()
        return self._dead

    def stop_accepting(self) -> None:
        """New generate() calls raise EngineStoppedError from now on (draining)."""
        self._accepting = False

    def end_grace(self) -> None:
        """Cut a running (or later) shutdown's grace period short: in-flight requests are aborted now."""
        self.cap_grace(0.0)

    def cap_grace(self, seconds: float) -> None:
        """A running (or later) shutdown waits at most `seconds` from now for in-flight requests."""
        self._grace_end = min(self._grace_end, time.monotonic() + seconds)

    async def shutdown(self, grace: float = 0.0) -> None:
        """Refuse new requests, let in-flight ones finish for `grace` s (or until end_grace()),
        abort the rest, stop."""
        self._accepting = False
        self._grace_end = min(self._grace_end, time.monotonic() + grace)
        while self._streams and self.is_healthy and time.monotonic() < self._grace_end:
            await asyncio.sleep(0.02)
        if self._streams and self.is_healthy:
            self.abort(list(self._streams), reason="server shutting down")
            t_end = time.monotonic() + 5.0
            while self._streams and self.is_healthy and time.monotonic() < t_end:
                await asyncio.sleep(0.02)
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._wake_engine()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30.0)
        for s in list(self._streams.values()):
            s.fail(EngineStoppedError("engine stopped"))
        self._streams.clear()
        self._ids.clear()
        self._num_seqs = 0
        with self._cond:  # commands the thread never took
            for cmd in self._swap_commands():
                if not isinstance(cmd, AbortRequests) and not cmd.future.done():
                    cmd.future.set_exception(EngineStoppedError("engine stopped"))

    def get_stats(self) -> EngineStats:
        """Stats as of the engine thread's last step (never blocks on the engine)."""
        return self._stats

    # ---- requests ----------------------------------------------------------------------
    async def generate(self, request: EngineRequest, *,
                       on_admitted: Callable[[], Awaitable[None]] | None = None) -> AsyncIterator[RequestOutput]:
        """Admit `request` (validated here, once), queue it and yield its outputs (DELTA kind;
        coalesced when read slowly).

        `on_admitted` is awaited once the engine has taken the request (before its prefill and
        any structured-output compile wait): the server sends its response headers there, so
        every refusal before it (invalid, queue full, draining, duplicate id) is a headers-free
        status that gRPC's retry policy may retry.

        Raises on the first iteration: InvalidRequestError / PromptTooLongError /
        LoRANotFoundError (admission), DuplicateRequestError, QueueFullError (llmsvc.core.errors),
        EngineDeadError, EngineStoppedError, or ConstraintError when the structured-output
        constraint does not compile (in time): the request waits in the engine (WAITING_FOR_FSM)
        while this awaits its compile, and is aborted before it produced anything.
        Later: EngineDeadError, OutputBacklogError. Closing or cancelling the generator before
        the final output aborts the request (its id stays reserved until the engine confirms).
        """
        self._check_running()
        admitted = self.engine.admit(request)
        params = admitted.request.sampling_params
        params.output_kind = RequestOutputKind.DELTA
        compiled = submit_constraint(self.engine, params)  # starts the compile now, off the engine thread
        request_id = request.request_id
        stream = self._admit(request_id, params.n)
        fut = self._loop.create_future()
        self._send(AddRequest(admitted, fut))
        try:
            await fut
        except asyncio.CancelledError:  # the add still happens: abort it (queued after the add)
            self._abort_stream(stream, "client went away")
            raise
        except BaseException:  # add_admitted refused it (or the engine died): never in the engine
            if self._streams.get(request_id) is stream:
                self._drop(request_id)
            raise
        if on_admitted is not None:
            try:
                await on_admitted()
            except BaseException:
                self._abort_stream(stream, "client went away")
                raise
        if compiled is not None:
            try:
                await wait_compiled(self.engine.structured_output_manager, compiled, params)
            except asyncio.CancelledError:
                self._abort_stream(stream, "client went away")
                raise
            except ConstraintError:
                self._abort_stream(stream, "structured-output constraint did not compile")
                raise
        try:
            while True:
                out = await stream.get()
                yield out
                if out.finished:
                    return
        finally:
            if not stream.finished:
                self._abort_stream(stream, "client went away")

    def abort(self, request_ids: list[str], reason: str = "aborted") -> list[str]:
        """Abort in-flight requests; their streams end with a final 'abort' output.

        Returns the ids that are not in flight. Idempotent."""
        not_found, found = [], []
        for rid in request_ids:
            s = self._streams.get(rid)
            if s is None or s.finished:
                not_found.append(rid)
                continue
            if not s.aborting:
                s.aborting, s.abort_reason = True, reason
                found.append(rid)
        if found:
            self._send(AbortRequests(found))
        return not_found

    # ---- event-loop internals ------------------------------------------------------------
    def _check_running(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"engine loop died: {self._dead}")
        if not self._accepting or self._loop is None:
            raise EngineStoppedError("engine is not accepting requests")

    def _admit(self, request_id: str, n: int = 1) -> RequestStream:
        """Reserve the id (the serving path's one duplicate check: in flight, or its abort not
        confirmed yet, or a sample's) and open its stream, unless too many wait."""
        check_free(request_id, n, self._ids.holder)
        # Waiting: in flight, but beyond what runs, in sequences (an n>1 request is n of them in
        # the engine, as num_running and max_num_seqs count). The engine's last stats may predate
        # a burst still arriving: while its queue was empty, the first max_num_seqs sequences are
        # counted as running (their slots were free), so a burst is not refused while slots idle.
        st = self._stats
        runnable = st.num_running if st.num_waiting else max(st.num_running, self.max_num_seqs)
        waiting = self._num_seqs - runnable
        if waiting >= self.max_waiting_requests:
            raise QueueFullError(f"{waiting} requests are waiting (max_waiting_requests="
                                 f"{self.max_waiting_requests}; a request with n samples counts n)")
        stream = RequestStream(request_id, self.max_backlog_bytes, self.max_backlog_age_s)
        stream.n = n
        self._ids.reserve(request_id, n)
        self._streams[request_id] = stream
        self._num_seqs += n
        return stream

    def _drop(self, request_id: str) -> None:
        stream = self._streams.pop(request_id)
        self._ids.release(request_id, stream.n)
        self._num_seqs -= stream.n

    def _abort_stream(self, stream: RequestStream, reason: str) -> None:
        if not stream.aborting and not stream.finished:
            stream.aborting, stream.abort_reason = True, reason
            self._send(AbortRequests([stream.request_id]))

    def _send(self, cmd) -> None:
        with self._cond:
            self._commands.append(cmd)
            self._cond.notify()
        self._wake_engine()

    def _wake_engine(self) -> None:
        wake = getattr(self.engine, "wake", None)
        if wake is not None:  # the engine thread may be blocked waiting on the engine-core process
            wake()

    def _on_outputs(self, outputs: list[RequestOutput], stats: EngineStats) -> None:
        self._stats = stats
        for out in outputs:
            s = self._streams.get(out.request_id)
            if s is None:
                continue
            ok = s.put(out)
            if s.finished:
                self._drop(out.request_id)
            elif not ok:
                logger.warning("request %s: output backlog over the cap; aborting", s.request_id)
                s.fail(OutputBacklogError(
                    f"client read too slowly: unsent output over {s.max_backlog_bytes} bytes "
                    f"or {s.max_backlog_age_s:g} s"))
                self._abort_stream(s, "output backlog over the cap")

    def _on_stats(self, stats: EngineStats) -> None:
        self._stats = stats

    def _on_dead(self, exc: BaseException) -> None:
        self._dead = exc
        self._dead_event.set()
        cls = EngineDeadError if is_worker_failure(exc) else EngineStepError
        err = cls(f"engine loop died: {type(exc).__name__}: {exc}")
        for s in list(self._streams.values()):
            s.fail(err)
        self._streams.clear()
        self._ids.clear()
        self._num_seqs = 0
