"""The engine-core process: EngineCore in a busy loop behind two ZeroMQ sockets.

Loop, one iteration: take every command waiting on the input socket (adds, aborts, utility
calls), run one EngineCore.step() if anything is unfinished, send one CoreOutputBatch. It never
waits for the front end, so detokenizing step N there overlaps with computing step N+1 here.
With async scheduling, step() returns with the next step already submitted, so the model also
computes while this loop sends the batch and takes the next commands.
While idle it blocks on the input socket and health-checks the executor once a second.

Lifecycle: spawned by MPClient -> builds executor + EngineCore -> ("ready", ReadyInfo) or
("failed", traceback) -> loop -> ("shutdown",) stops the executor and exits 0. A failure in the
loop sends ("dead", error type, message), stops the executor and exits 1. The front end's end
of a death pipe closing (the front end died, even by SIGKILL) ends this process at once; its
workers follow through their own death pipes.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import traceback

import zmq

from executors.worker_proc import name_os_thread, watch_parent
from llmsvc.core import messages as m
from llmsvc.core.burst import IDLE_HEALTH_CHECK_S, BurstWindow
from llmsvc.core.core_output import EngineCoreOutput
from llmsvc.core.errors import PromptTooLongError, QueueFullError
from llmsvc.outputs import ABORT
from llmsvc.structured.errors import ConstraintError

logger = logging.getLogger("llmsvc.core")

PROCESS_NAME = "llmsvc-core"  # /proc/PID/comm: what top and `ps -o comm` show


def _watch_front_end(death_reader, in_addr: str) -> None:
    """watch_parent, and on the front end's death remove the socket directory it made (a
    killed front end cannot: each SIGKILL left a /tmp/llmsvc-core-* directory behind)."""
    import shutil

    if in_addr.startswith("ipc://"):
        sock_dir = os.path.dirname(in_addr[len("ipc://"):])
        try:
            death_reader.recv()
        except (EOFError, OSError):
            pass
        shutil.rmtree(sock_dir, ignore_errors=True)
        os._exit(1)
    watch_parent(death_reader)


def run_engine_core(config, in_addr: str, out_addr: str, death_reader, log_level: int,
                    log_formatter: logging.Formatter | None, log_filters: list) -> None:
    """Process entry point (multiprocessing spawn target). Logs to stderr like the front end:
    its root handler's formatter and filters come pickled (json or text, same fields)."""
    # Ctrl-C, and a supervisor that signals the whole group (systemd's default, `kill -- -PGID`),
    # reach this process too: the front end decides. It drains, then stops the core itself (or the
    # death pipe ends it), so in-flight requests finish instead of dying with the core.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    name_os_thread(PROCESS_NAME)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(log_formatter or logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    for f in log_filters:
        handler.addFilter(f)
    logging.basicConfig(level=log_level, handlers=[handler], force=True)
    threading.Thread(target=_watch_front_end, args=(death_reader, in_addr), daemon=True, name="death-pipe").start()
    ctx = zmq.Context()
    inp = ctx.socket(zmq.PULL)
    inp.connect(in_addr)
    out = ctx.socket(zmq.PUSH)
    out.connect(out_addr)
    try:
        from executors import create_executor
        from llmsvc.core.engine_core import EngineCore
        from llmsvc.worker.device import resolve_device_type

        if config.model_config.model_dir is None:  # spawned before the front end resolved it
            from llmsvc.models.resolve import resolve_model_config

            config = config.replace(model_config=resolve_model_config(config.model_config, config.device))
        from llmsvc.models.tp_split import check_tensor_parallel
        check_tensor_parallel(config.model_config.hf_config, config.parallel_config.tensor_parallel_size)
        config = config.replace(device=resolve_device_type(config.device))  # before any worker starts
        executor = create_executor(config)
        try:
            core = EngineCore(config, executor, _structured_output_manager(config))
        except BaseException:
            executor.shutdown()
            raise
    except (ValueError, FileNotFoundError) as e:  # the configuration does not fit the model or this machine
        # (or names files that are not there): one line
        logger.error("engine core failed to start: %s", e)
        logger.debug("engine core failed to start", exc_info=True)
        out.send(m.encode((m.FAILED, (m.FAILED_CONFIG, str(e)))))
        _flush_and_exit(ctx, 1)
    except BaseException:
        msg = traceback.format_exc()
        logger.error("engine core failed to start:\n%s", msg)
        out.send(m.encode((m.FAILED, (m.FAILED_ERROR, msg))))
        _flush_and_exit(ctx, 1)
    out.send(m.encode((m.READY, m.ReadyInfo(os.getpid(), core.max_len, core.stats, config.device))))
    code = EngineCoreLoop(core, inp, out, config.scheduler_config).run()
    _flush_and_exit(ctx, code)


def _structured_output_manager(config):
    """This process' grammar manager (masks and grammar state live beside the scheduler), on the
    model's tokenizer; None when structured output cannot be served. Built on the first
    constrained request: loading the tokenizer and its token table is start-up time that
    unconstrained serving never needs."""
    from llmsvc import structured

    if not structured.available():
        return None
    from llmsvc.structured.lazy import LazyStructuredOutputManager

    def build():
        from llmsvc.models.cache_files import derived_cache_dir
        from llmsvc.models.tokenizer import load_tokenizer
        from llmsvc.structured.build import build_structured_output_manager

        tokenizer = load_tokenizer(config.model_config.tokenizer_dir, derived_cache_dir())
        return build_structured_output_manager(config, tokenizer)

    return LazyStructuredOutputManager(build)


def _flush_and_exit(ctx, code: int) -> None:
    ctx.destroy(linger=2000)  # closes both sockets; lets the last message reach the front end
    sys.stderr.flush()
    os._exit(code)


class EngineCoreLoop:
    def __init__(self, core, inp: zmq.Socket, out: zmq.Socket, scheduler_config=None) -> None:
        self.core = core
        self.inp, self.out = inp, out
        sc = scheduler_config
        self.burst = BurstWindow(sc.burst_wait_ms, sc.max_num_batched_tokens, sc.max_num_seqs) if sc else None

    def run(self) -> int:
        """Returns the exit code: 0 after a shutdown command, 1 after a failure."""
        core = self.core
        try:
            while True:
                idle = not core.has_unfinished()
                if idle and not self.inp.poll(1e3 * IDLE_HEALTH_CHECK_S):
                    core.executor.check_health()
                    continue
                aborted, utility, refused = [], [], []
                if self.burst is not None:
                    self.burst.reset()
                if self._drain_inputs(aborted, utility, refused) or (
                        idle and self._gather_burst(aborted, utility, refused)):
                    core.shutdown()
                    return 0
                outputs, executed = core.step() if core.has_unfinished() else ([], False)
                # the step's KV events go with its outputs: a gateway knows what a request
                # cached before its client sees it finish
                kv_events = core.drain_kv_events()
                if outputs or executed or aborted or utility or refused or kv_events:
                    self.out.send(m.encode((m.OUTPUTS, m.CoreOutputBatch(
                        refused + outputs, executed, core.stats, aborted, utility, kv_events))), copy=False)
        except BaseException as e:  # noqa: BLE001 - every failure is reported, then the process ends
            logger.exception("engine core loop died")
            self.out.send(m.encode((m.DEAD, type(e).__name__, f"{e}")))
            try:
                core.shutdown()
            except Exception:  # noqa: BLE001
                logger.exception("executor shutdown failed")
            return 1

    def _gather_burst(self, aborted: list, utility: list, refused: list) -> bool:
        """The loop was idle: take the rest of a burst before the first step (burst.py).
        Returns True on a shutdown command."""
        if self.burst is None:
            return False
        return self.burst.gather(self.core.seconds_per_token, lambda s: bool(self.inp.poll(1e3 * s)),
                                 lambda: self._drain_inputs(aborted, utility, refused))

    def _drain_inputs(self, aborted: list, utility: list, refused: list) -> bool:
        """Apply every waiting command. Returns True on a shutdown command."""
        core = self.core
        while True:
            try:
                frame = self.inp.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return False
            msg = m.decode(frame.buffer)
            kind = msg[0]
            if kind == m.ADD:
                request = msg[1]
                try:
                    core.add_request(request)
                    if self.burst is not None:
                        self.burst.add(request.num_prompt_tokens)
                except (PromptTooLongError, QueueFullError, ConstraintError) as e:
                    # the front end checked the first two (a race at most); a ConstraintError is this
                    # core's cached failure to compile the constraint, which the front end reports
                    # from its own compile of it
                    logger.warning("request %s refused by the engine core: %s", request.request_id, e)
                    refused.append(EngineCoreOutput(request.request_id, [], finish_reason=ABORT))
            elif kind == m.ABORT:
                core.abort_requests(msg[1], msg[2])
                aborted.extend(msg[1])
            elif kind == m.UTILITY:
                _, call_id, method, args = msg
                utility.append((call_id, self._utility(method, args)))
            elif kind == m.SHUTDOWN:
                return True
            else:
                raise ValueError(f"unknown engine-core command {kind!r}")

    def _utility(self, method: str, args: tuple):
        if method == "reset_prefix_cache":
            return self.core.kv_cache_manager.pool.reset_prefix_cache()
        if method in ("add_lora", "remove_lora", "take_kv_events"):
            return getattr(self.core, method)(*args)
        raise ValueError(f"unknown engine-core utility {method!r}")
