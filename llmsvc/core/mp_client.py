"""MPClient: the engine core in its own process (llmsvc.core.proc), reached over ZeroMQ.

Sockets (ipc:// in a private temporary directory): the front end binds a PUSH socket for
commands and a PULL socket for output batches; the core connects to both. One message per
command, one per core loop iteration. Threads: one thread at a time drives the client (the
AsyncEngine's engine thread); wake() may be called from any thread.

Start-up is split so the caller can overlap its own work (tokenizer load) with the core's
model load: the constructor spawns the process and returns; wait_ready() waits for READY.

Death: get_output() polls the output socket, the process sentinel and the wake pipe together,
so a killed core is noticed at once and raises EngineCoreDeadError (an ExecutorError: the
server answers UNAVAILABLE and exits non-zero).
"""
from __future__ import annotations

import atexit
import itertools
import logging
import multiprocessing as mp
import os
import pickle
import shutil
import tempfile
import time

import zmq

from executors.base import ExecutorError
from llmsvc.config import EngineConfig
from llmsvc.core import messages as m
from llmsvc.core.proc_tree import descendants, kill_all
from llmsvc.core.client import EngineCoreClient
from llmsvc.core.proc import run_engine_core
from llmsvc.core.core_output import EngineCoreOutput
from llmsvc.core.kv_events import KVEventJournal, KVEventPage
from llmsvc.core.request import Request
from llmsvc.outputs import ABORT, EngineStats

logger = logging.getLogger(__name__)


def _log_format() -> tuple[logging.Formatter | None, list]:
    """The root handler's formatter and filters, for the core to log the same way (json or text);
    (None, []) where they cannot cross a process boundary (e.g. a test runner's handler)."""
    root = logging.getLogger()
    if not root.handlers:
        return None, []
    handler = root.handlers[0]
    try:
        pickle.dumps((handler.formatter, handler.filters))
    except Exception:  # noqa: BLE001 - any unpicklable state: the core uses a plain format
        return None, []
    return handler.formatter, list(handler.filters)


class EngineCoreDeadError(ExecutorError):
    """The engine-core process died or reported a fatal error."""


class MPClient(EngineCoreClient):
    startup_timeout_s = 900.0
    shutdown_timeout_s = 10.0

    def __init__(self, config: EngineConfig) -> None:
        self._dir = tempfile.mkdtemp(prefix="llmsvc-core-")
        self._ctx = zmq.Context()
        self._cmd = self._ctx.socket(zmq.PUSH)
        self._cmd.bind(f"ipc://{self._dir}/cmd")
        self._out = self._ctx.socket(zmq.PULL)
        self._out.bind(f"ipc://{self._dir}/out")
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        ctx = mp.get_context("spawn")
        death_reader, self._death_writer = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(
            target=run_engine_core, name="llmsvc-engine-core",
            args=(config, f"ipc://{self._dir}/cmd", f"ipc://{self._dir}/out", death_reader,
                  logging.getLogger().getEffectiveLevel(), *_log_format()))
        # Not a daemon: the core may start worker processes of its own. The core's OpenMP
        # threads keep libgomp's default wait (spin, then sleep), as in-process: on a dedicated
        # machine passive waits cost 8-17% over gRPC (docs/engine-core.md); hosts shared with
        # other CPU-heavy programs set OMP_WAIT_POLICY=PASSIVE, which the core inherits.
        self.proc.start()
        death_reader.close()
        # before multiprocessing's own exit hook, which would wait forever for a core never shut down
        atexit.register(self.shutdown)
        self._poller = zmq.Poller()
        self._poller.register(self._out, zmq.POLLIN)
        self._poller.register(self.proc.sentinel, zmq.POLLIN)
        self._poller.register(self._wake_r, zmq.POLLIN)
        self._send_poller = zmq.Poller()
        self._send_poller.register(self._cmd, zmq.POLLOUT)
        self._send_poller.register(self.proc.sentinel, zmq.POLLIN)
        self._outstanding: set[str] = set()  # added, not yet reported finished nor aborted
        self._aborting: set[str] = set()  # aborted, abort not yet acknowledged: drop their outputs
        self._stats = EngineStats()
        self._max_len = 0
        self._call_ids = itertools.count()
        self._replies: dict[int, object] = {}
        self._held: list[tuple[list[EngineCoreOutput], bool]] = []  # read while waiting for a reply
        self._kv_events = KVEventJournal(0)  # the core's, as pushed with each batch
        self._kv_on = False  # the core records them (turned on by the first take_kv_events)
        self._dead: str | None = None
        self._closed = False
        self._ready = False

    def wait_ready(self) -> None:
        """Block until the core has loaded and warmed the model (raises if it failed)."""
        if self._ready:
            return
        t0 = time.perf_counter()
        msg = self._recv(self.startup_timeout_s * 1000, "start-up")
        if msg is None:
            self.shutdown()
            raise EngineCoreDeadError(f"engine core did not start in {self.startup_timeout_s:.0f}s")
        if msg[0] != m.READY:
            self.shutdown()
            kind, text = msg[1]
            if kind == m.FAILED_CONFIG:  # e.g. --device cuda on a machine without a GPU
                raise ValueError(text)
            raise EngineCoreDeadError(f"engine core failed to start:\n{text}")
        info: m.ReadyInfo = msg[1]
        self._max_len, self._stats, self._ready = info.max_len, info.stats, True
        self.device = info.device
        logger.info("engine core ready in process %d (%.1fs after the wait began)", info.pid,
                    time.perf_counter() - t0)

    # ---- plumbing ---------------------------------------------------------------------------
    def _send(self, msg: tuple) -> None:
        """Queue one command for the core. A PUSH socket blocks while no peer is connected, so a
        core that died would hang a plain send forever: wait for room and the sentinel together."""
        if self._dead is not None:
            raise EngineCoreDeadError(self._dead)
        frame = m.encode(msg)
        while True:
            try:
                self._cmd.send(frame, zmq.NOBLOCK, copy=False)
                return
            except zmq.Again:  # the core is gone, or not connected yet, or its queue is full
                events = dict(self._send_poller.poll(1000))
                if self.proc.sentinel in events:
                    self._died("a send")

    def _recv(self, timeout_ms: float | None, what: str) -> tuple | None:
        """The next message from the core; None on timeout or wake(). Raises once the core died."""
        if self._dead is not None:
            raise EngineCoreDeadError(self._dead)
        events = dict(self._poller.poll(timeout_ms))
        if self._out in events:
            return self._decode(self._out.recv(copy=False))
        if self._wake_r in events:
            self._clear_wake()
            return None
        if self.proc.sentinel in events:  # died; a last message may still be in the socket
            if self._out.poll(200):
                return self._decode(self._out.recv(copy=False))
            self._died(what)
        return None

    def _died(self, what: str) -> None:
        """The process is gone: raise its last word (DEAD, which _decode raises) or its exit code;
        outputs still queued are of no use to anyone now."""
        while self._out.poll(200):
            self._decode(self._out.recv(copy=False))
        self.proc.join(1.0)
        self._dead = (f"engine-core process (pid {self.proc.pid}) died with exit code {self.proc.exitcode} "
                      f"during {what}")
        raise EngineCoreDeadError(self._dead)

    def _decode(self, frame) -> tuple:
        msg = m.decode(frame.buffer)
        if msg[0] == m.DEAD:
            self._dead = f"engine core died: {msg[1]}: {msg[2]}"
            raise EngineCoreDeadError(self._dead)
        return msg

    def _clear_wake(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass

    def _apply(self, batch: m.CoreOutputBatch) -> tuple[list[EngineCoreOutput], bool]:
        self._stats = batch.stats
        if batch.kv_events:
            self._kv_events.extend(batch.kv_events)
        self._aborting.difference_update(batch.aborted)
        for call_id, result in batch.utility:
            self._replies[call_id] = result
        outputs = []
        for out in batch.outputs:
            if out.req_id in self._aborting or out.req_id not in self._outstanding:
                continue  # computed before the core saw our abort
            if out.finished:
                self._outstanding.discard(out.req_id)
            outputs.append(out)
        return outputs, batch.executed

    # ---- EngineCoreClient ---------------------------------------------------------------------
    @property
    def max_len(self) -> int:
        self.wait_ready()
        return self._max_len

    def add_request(self, request: Request) -> None:
        self._send((m.ADD, request))
        self._outstanding.add(request.request_id)

    def abort_requests(self, req_ids: list[str], reason: str = ABORT) -> None:
        if not req_ids:
            return
        self._send((m.ABORT, list(req_ids), reason))
        self._outstanding.difference_update(req_ids)
        self._aborting.update(req_ids)

    def get_output(self) -> tuple[list[EngineCoreOutput], bool]:
        """Wait for the next batch while requests are outstanding or an abort is unacknowledged (or
        until wake()), then take every batch already queued; outputs of several core steps come
        back merged."""
        outputs, executed = [], False
        for outs, ran in self._held:
            outputs += outs
            executed |= ran
        self._held.clear()
        timeout = None if (self._outstanding or self._aborting) and not outputs else 0
        while True:
            msg = self._recv(timeout, "a step")
            if msg is None:
                return outputs, executed
            outs, ran = self._apply(msg[1])
            outputs += outs
            executed |= ran
            timeout = 0

    def has_unfinished(self) -> bool:
        # an unacknowledged abort counts: the caller steps on until the core's batch saying so
        # (and carrying the stats with the request gone) has been read, even on an idle server
        return bool(self._outstanding) or bool(self._held) or bool(self._aborting)

    def get_stats(self) -> EngineStats:
        return self._stats

    def reset_prefix_cache(self) -> bool:
        return bool(self.call_utility("reset_prefix_cache"))

    def call_utility(self, method: str, *args):
        call_id = next(self._call_ids)
        self._send((m.UTILITY, call_id, method, args))
        while call_id not in self._replies:
            msg = self._recv(1000, method)
            if msg is not None:
                self._held.append(self._apply(msg[1]))
        return self._replies.pop(call_id)

    def take_kv_events(self, after_seq: int) -> KVEventPage:
        """From the mirror of the core's journal: no round trip but the first, which turns the
        core's recording on (its events come with every batch after that)."""
        if not self._kv_on:
            page = self.call_utility("take_kv_events", 0)
            self._kv_events.block_size = page.block_size
            self._kv_events.extend(page.events)
            self._kv_on = True
        return self._kv_events.take(after_seq)

    def check_health(self) -> None:
        if self._dead is not None:
            raise EngineCoreDeadError(self._dead)
        while self._out.poll(0):  # an idle core says it died before it exits (its executor's
            # shutdown may take seconds, e.g. a TP rank > 0 gone): read it now (raises on DEAD)
            self._held.append(self._apply(self._decode(self._out.recv(copy=False))[1]))
        if self.proc.exitcode is not None:
            self._dead = f"engine-core process (pid {self.proc.pid}) died with exit code {self.proc.exitcode}"
            raise EngineCoreDeadError(self._dead)

    def wake(self) -> None:
        if self._closed:
            return
        try:
            os.write(self._wake_w, b"w")
        except (BlockingIOError, OSError):  # already signalled, or closed at shutdown
            pass

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.shutdown)
        if self.proc.exitcode is None and self._dead is None:
            try:
                self._cmd.send(m.encode((m.SHUTDOWN,)), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        # still loading, it reads no commands: nothing of its work is lost by stopping it now
        self.proc.join(self.shutdown_timeout_s if self._ready else 0.5)
        if self.proc.exitcode is None:  # loading, or hung (a stopped or stuck worker): its workers go too
            workers = descendants(self.proc.pid)
            self.proc.kill()  # it ignores SIGTERM (a signal to the whole group is the front end's to act on)
            self.proc.join(2.0)
            left = kill_all(workers)
            if self._ready:
                logger.error("engine core did not stop within %.0f s: killed it%s", self.shutdown_timeout_s,
                             f" and {left} process(es) it had started" if left else "")
        self._death_writer.close()
        self._cmd.close(linger=0)
        self._out.close(linger=0)
        self._ctx.term()
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)
        shutil.rmtree(self._dir, ignore_errors=True)
        logger.info("engine core stopped (exit code %s)", self.proc.exitcode)
