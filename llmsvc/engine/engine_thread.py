"""The engine thread of AsyncEngine: the only caller of the wrapped LLMEngine.

It sleeps on AsyncEngine's condition while there is nothing to do (health-checking the engine
once per `health_check_interval_s`, IDLE_HEALTH_CHECK_S as the core process), applies the queued commands (adds, aborts, utility
calls), runs one engine step and posts its outputs to the event loop in one callback. With an
inline engine core, a burst of requests that finds the engine idle is gathered before the first
step (llmsvc/core/burst.py), as the engine-core process does for its own core.

The mixin keeps no state of its own (the burst window is a local of the thread); it uses
AsyncEngine's engine, _cond, _commands, _stop, _loop, _stats, _dead, _kv_listener, _kv_cursor
and its event-loop callbacks (_on_outputs, _on_stats, _on_dead).
"""
from __future__ import annotations

import asyncio
import logging
from collections import deque

from executors.worker_proc import name_os_thread
from llmsvc.core.burst import BurstWindow
from llmsvc.engine.commands import AbortRequests, AddRequest, UtilityCall
from llmsvc.engine.errors import EngineDeadError, is_worker_failure
from llmsvc.outputs import EngineStats

logger = logging.getLogger("llmsvc.engine.async_engine")  # the engine thread logs as AsyncEngine did


class EngineThreadMixin:
    def _make_burst(self) -> BurstWindow | None:
        """A burst window when the core runs inline (a core process keeps its own)."""
        config = self.engine.config
        if config.engine_core != "inline":  # the core process gathers bursts itself (proc.py)
            return None
        sc = config.scheduler_config
        return BurstWindow(sc.burst_wait_ms, sc.max_num_batched_tokens, sc.max_num_seqs)

    def _safe_stats(self) -> EngineStats:
        try:
            return self.engine.get_stats()
        except Exception:  # stats are best effort
            return self._stats

    def _post(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # loop closed: nobody is listening any more
            pass

    def _swap_commands(self) -> list:
        """The queued commands, leaving the queue empty; the caller holds _cond."""
        cmds, self._commands = list(self._commands), deque()
        return cmds

    def _take_commands(self, timeout: float) -> list:
        """The queued commands, after waiting up to timeout seconds for one."""
        with self._cond:
            if not self._commands and not self._stop:
                self._cond.wait(timeout)
            return self._swap_commands()

    def _apply(self, cmds: list, burst: BurstWindow | None) -> bool:
        """Apply adds, aborts and calls in order. Returns whether any was an abort."""
        engine, had_abort = self.engine, False
        for cmd in cmds:
            if isinstance(cmd, AbortRequests):
                engine.abort_request(cmd.request_ids)
                had_abort = True
            elif isinstance(cmd, UtilityCall):
                self._call(cmd)
            else:
                self._add(cmd, burst)
        return had_abort

    def _add(self, cmd: AddRequest, burst: BurstWindow | None) -> None:
        try:
            self.engine.add_admitted(cmd.admitted)
        except Exception as e:  # a duplicate id, or a refusal of the core's: goes back to the caller
            if is_worker_failure(e):  # the engine core died (seen on the send): all fail
                self._post(_set_future, cmd.future, EngineDeadError(f"engine loop died: {e}"))
                raise
            self._post(_set_future, cmd.future, e)
        else:
            self._post(_set_future, cmd.future, None)
            if burst is not None:
                burst.add(len(cmd.admitted.request.prompt_token_ids))

    def _call(self, call: UtilityCall) -> None:
        """engine.<method>(*args) for AsyncEngine's utility calls; its result or error goes to the future."""
        try:
            result = getattr(self.engine, call.method)(*call.args)
        except Exception as e:
            self._post(_set_future, call.future, e)
            if is_worker_failure(e):  # the engine core died: so does this loop
                raise
        else:
            self._post(_set_future, call.future, None, result)

    def _push_kv_events(self) -> None:
        """The prefix cache's new events to the follower (follow_kv_events), posted before the
        outputs of the step that made them."""
        listener = self._kv_listener
        if listener is None:
            return
        while True:  # a page holds at most take()'s limit
            page = self.engine.take_kv_events(self._kv_cursor)
            if not page.events:
                return
            self._kv_cursor = page.events[-1][0]
            self._post(listener, page)

    def _gather_burst(self, burst: BurstWindow) -> bool:
        """The engine was idle: take the rest of a burst before the first step. Returns whether
        an abort came meanwhile."""
        core = getattr(self.engine, "core", None)  # test fakes have none: no step cost known
        taken: list = []

        def wait(seconds: float) -> bool:
            taken[:] = [] if self._stop else self._take_commands(seconds)
            return bool(taken)

        had_abort = False

        def take() -> bool:
            nonlocal had_abort
            had_abort |= self._apply(taken, burst)
            return False

        burst.gather(getattr(core, "seconds_per_token", None), wait, take)
        return had_abort

    def _run(self) -> None:
        engine = self.engine
        name_os_thread("llmsvc-engine")
        burst = self._make_burst()
        try:
            self._post(self._on_stats, self._safe_stats())
            while True:
                with self._cond:
                    idle = False
                    while not self._commands and not self._stop and not engine.has_unfinished_requests():
                        if not self._cond.wait(self.health_check_interval_s):
                            idle = True
                            break
                    if self._stop:
                        break
                    cmds = self._swap_commands()
                if idle and not cmds:  # nothing to do for a while: make sure the workers still live
                    check = getattr(engine, "check_health", None)
                    if check is not None:
                        check()
                    log_stats = getattr(engine, "log_stats", None)  # the throughput line keeps its interval
                    if log_stats is not None:
                        log_stats()
                    continue
                was_idle = not engine.has_unfinished_requests()
                if burst is not None:
                    burst.reset()
                had_abort = self._apply(cmds, burst)
                if burst is not None and was_idle:
                    had_abort |= self._gather_burst(burst)
                if had_abort or engine.has_unfinished_requests():
                    outputs = engine.step()
                    self._push_kv_events()
                    self._post(self._on_outputs, outputs, self._safe_stats())
                else:
                    self._push_kv_events()  # a utility call's (a flush's `cleared`)
                    self._post(self._on_stats, self._safe_stats())
        except BaseException as e:  # noqa: BLE001 - any failure kills the loop; streams are told
            logger.exception("engine loop died")
            with self._cond:
                pending = self._swap_commands()
            err = EngineDeadError(f"engine loop died: {type(e).__name__}: {e}")
            for cmd in pending:
                if not isinstance(cmd, AbortRequests):  # adds and calls wait on a future
                    self._post(_set_future, cmd.future, err)
            self._dead = e
            self._post(self._on_dead, e)
        finally:
            try:
                engine.shutdown()
            except Exception:
                logger.exception("engine shutdown failed")


def _set_future(fut: asyncio.Future, exc: BaseException | None, result=None) -> None:
    if fut.done():
        return
    if exc is None:
        fut.set_result(result)
    else:
        fut.set_exception(exc)
