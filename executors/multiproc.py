"""MultiprocExecutor: workers in spawned child processes, driven over pipes.

With world_size 1 this keeps model compute (and its GIL) out of the server process; the
tensor-parallel executor is the same machinery with N ranks. Lifecycle, as vLLM's:
spawn -> READY (after the model loaded) or (FAILURE, msg) -> calls -> shutdown message ->
join -> SIGTERM -> SIGKILL. A death pipe makes children exit when the driver dies.

A non-blocking execute_model only sends the step: rank 0 reads calls in order and answers each
in order, so the replies are read back (by whichever future's result, or later call, needs them
first) from the pipe in submission order. No extra thread is involved.
"""
from __future__ import annotations

import atexit
import logging
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import pickle
import socket
import sys
import time
from collections import deque
from concurrent.futures import Future

from executors.base import Executor, ExecutorError
from executors.worker_proc import FAILURE, OK, READY, worker_main
from llmsvc.config import EngineConfig
from llmsvc.wire import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)

# A spawned worker first re-runs the parent's main script (as "__mp_main__"). A script that builds
# a multiproc engine at top level, unguarded, would build one again in every worker; the worker
# exits with this code instead, and the parent says what to add.
UNGUARDED_MAIN_EXIT = 86
UNGUARDED_MAIN_HINT = (
    "the main script creates a multiprocess engine at top level: worker processes are spawned and "
    "re-run the main script, so put that code under `if __name__ == \"__main__\":` "
    "(or use executor=\"uniproc\")")


def _exit_if_reimported_main() -> None:
    """In a spawned worker that is re-running the parent's unguarded main script: explain, exit.
    (While multiprocessing re-runs it, the script runs as module "__mp_main__", not yet __main__.)"""
    rerun = sys.modules.get("__mp_main__")
    if rerun is not None and rerun is not sys.modules.get("__main__"):
        sys.stderr.write(f"llmsvc worker: {UNGUARDED_MAIN_HINT}\n")
        sys.stderr.flush()
        os._exit(UNGUARDED_MAIN_EXIT)


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class MultiprocExecutor(Executor):
    name = "multiproc"
    startup_timeout_s = 900.0
    # a call to the workers after start-up that takes longer is a hung worker (vLLM's
    # VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS, also 300): the engine fails instead of waiting forever
    call_timeout_s = 300.0
    # an idle multi-node group is pinged this often: a rank on another machine has no sentinel here
    remote_ping_s = 2.0

    def __init__(self, config: EngineConfig, world_size: int = 1) -> None:
        _exit_if_reimported_main()
        super().__init__(config)
        timeout = os.environ.get("LLMSVC_EXECUTE_MODEL_TIMEOUT_S")
        if timeout:
            try:
                self.call_timeout_s = float(timeout)
            except ValueError:
                self.call_timeout_s = float("nan")
            if not self.call_timeout_s > 0 or self.call_timeout_s == float("inf"):
                raise ValueError(f"LLMSVC_EXECUTE_MODEL_TIMEOUT_S={timeout!r}: must be a number of seconds > 0")
        pc = config.parallel_config
        self.world_size = world_size
        self.nnodes = pc.nnodes if world_size > 1 else 1
        if self.nnodes > 1 and not pc.master_port:
            raise ValueError("multi-node tensor parallelism needs an explicit master_port on every node")
        local = world_size // self.nnodes
        first_rank = pc.node_rank * local if self.nnodes > 1 else 0
        self.ranks = list(range(first_rank, first_rank + local))  # global ranks started on this node
        port = pc.master_port or _free_port(pc.master_addr)
        init_method = f"tcp://{pc.master_addr}:{port}"
        ctx = mp.get_context("spawn")
        death_reader, self._death_writer = ctx.Pipe(duplex=False)
        threads = max(1, (os.cpu_count() or 1) // local)
        self.procs: list[mp.Process] = []
        self.conns = []
        self._closed = False
        self._failed = False  # a call failed: the group is abandoned, not shut down cleanly
        self._pending: deque[_ReplyFuture] = deque()  # non-blocking calls sent, reply not read yet
        self._last_send = time.monotonic()
        t0 = time.perf_counter()
        for local_rank in range(local):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=worker_main, name=f"llmsvc-worker-{first_rank + local_rank}",
                            args=(config, first_rank + local_rank, world_size, local_rank, init_method,
                                  child, death_reader, threads, logging.getLogger().getEffectiveLevel()),
                            daemon=True)
            p.start()
            child.close()
            self.procs.append(p)
            self.conns.append(parent)
        death_reader.close()
        try:
            for rank, conn in zip(self.ranks, self.conns):
                kind, payload = self._recv(conn, self.startup_timeout_s, f"rank {rank} start-up")
                if kind != READY:
                    raise ExecutorError(f"worker rank {rank} failed to start:\n{payload}")
        except BaseException:
            self.shutdown()
            raise
        # before multiprocessing's own exit hook, which SIGTERMs its daemon children and joins them:
        # the workers ignore SIGTERM (worker_proc), so a script that never shut the executor down
        # would wait there forever
        atexit.register(self.shutdown)
        logger.info("executor %s started: ranks %s of %d in worker process(es) %s, %s, in %.1fs", self.name,
                    self.ranks, world_size, [p.pid for p in self.procs],
                    init_method if world_size > 1 else "pipes", time.perf_counter() - t0)

    # -- plumbing ---------------------------------------------------------------------------
    def _dead(self) -> str | None:
        for rank, p in zip(self.ranks, self.procs):
            if p.exitcode == UNGUARDED_MAIN_EXIT:
                return f"worker rank {rank} (pid {p.pid}) could not start: {UNGUARDED_MAIN_HINT}"
            if p.exitcode is not None:
                return f"worker rank {rank} (pid {p.pid}) died with exit code {p.exitcode}"
        return None

    def _recv(self, conn, timeout: float | None, what: str):
        try:
            return self._recv_or_raise(conn, timeout, what)
        except ExecutorError:
            self._failed = True
            raise

    def _recv_or_raise(self, conn, timeout: float | None, what: str):
        deadline = None if timeout is None else time.monotonic() + timeout
        sentinels = [p.sentinel for p in self.procs]
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = mpc.wait([conn, *sentinels], timeout=left)
            if conn in ready:
                try:
                    return pickle.loads(conn.recv_bytes())
                except (EOFError, OSError) as e:
                    # its process is exiting: wait (briefly) for its exit code, which may explain why
                    self.procs[self.conns.index(conn)].join(2.0)
                    raise ExecutorError(f"lost worker pipe during {what}: {self._dead() or e}") from e
            if ready:  # a process sentinel fired
                time.sleep(0.05)
                if conn.poll():
                    continue
                raise ExecutorError(f"{self._dead() or 'a worker died'} during {what}")
            if deadline is not None and time.monotonic() >= deadline:
                raise ExecutorError(f"timed out after {timeout:g} s waiting for {what} (a worker is hung; "
                                    "LLMSVC_EXECUTE_MODEL_TIMEOUT_S sets the limit)")

    def _call(self, method: str, *args, timeout: float | None = None):
        self._read_pending()
        self._send(method, args)
        try:
            return self._reply(method, timeout)
        except ExecutorError:
            raise
        except BaseException:
            # interrupted (Ctrl-C) while rank 0 still works on the call: its reply comes later
            # and must be read, and dropped, before the next call's
            self._pending.append(_ReplyFuture(self))
            raise

    def _send(self, method: str, args: tuple) -> None:
        if self._closed:
            raise ExecutorError("executor is shut down")
        if self.ranks[0] != 0:
            raise ExecutorError("this node has no rank 0: node 0 drives the group (headless node)")
        dead = self._dead()
        if dead:
            raise ExecutorError(dead)
        self._last_send = time.monotonic()
        try:
            self.conns[0].send_bytes(pickle.dumps((method, args), protocol=pickle.HIGHEST_PROTOCOL))
        except (BrokenPipeError, OSError) as e:
            raise ExecutorError(f"cannot reach worker rank 0: {self._dead() or e}") from e

    def _reply(self, method: str, timeout: float | None = None):
        kind, payload = self._recv(self.conns[0], timeout or self.call_timeout_s, method)
        if kind == FAILURE:
            raise ExecutorError(f"worker failed in {method}:\n{payload}")
        assert kind == OK, kind
        return payload

    # -- Executor ---------------------------------------------------------------------------
    def determine_num_kv_blocks(self) -> int:
        return self._call("determine_num_kv_blocks")

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self._call("initialize_kv_cache", num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput,
                      non_block: bool = False) -> ModelRunnerOutput | Future:
        if not non_block:
            return self._call("execute_model", scheduler_output)
        self._send("execute_model", (scheduler_output,))
        future = _ReplyFuture(self)
        self._pending.append(future)
        return future

    def _read_pending(self, until: Future | None = None) -> None:
        """Read the replies of the non-blocking calls sent, oldest first, up to `until`."""
        while self._pending:
            future = self._pending[0]  # left in line until its reply is read: an interrupt may come first
            try:
                result = self._reply("execute_model")
            except ExecutorError as e:
                self._pending.popleft().set_exception(e)
            else:
                self._pending.popleft().set_result(result)
            if future is until:
                return

    def collective_rpc(self, method: str, *args):
        return self._call(method, *args)

    def execute_stats(self) -> dict:
        """Rank 0's {"num_steps", "execute_time_s"} (benchmarks: IPC overhead = driver time - this)."""
        return self._call("execute_stats")

    def check_health(self) -> None:
        dead = self._dead()
        if dead:
            raise ExecutorError(dead)
        # Ranks on other machines: rank 0 broadcasts a no-op to the group. Its broadcast fails
        # (and rank 0 exits) when a remote rank went away, and outlasts call_timeout_s when one
        # hangs, so an idle node 0 notices within seconds, as it does its own workers' deaths.
        if (self.nnodes > 1 and self.ranks[0] == 0 and not self._pending and not self._closed
                and time.monotonic() - self._last_send >= self.remote_ping_s):
            self._call("ping")

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.shutdown)
        for future in self._pending:  # steps still in flight: their replies are never read
            future.cancel()
        self._pending.clear()
        if self._dead() is None and self.conns and self.ranks[0] == 0:  # only rank 0 reads calls
            # after a failed call every rank exits 1: a headless node must not report a clean
            # shutdown of a group whose node 0 failed (its supervisor would not restart it)
            call = ("abandon" if self._failed else "shutdown", ())
            try:
                self.conns[0].send_bytes(pickle.dumps(call, protocol=pickle.HIGHEST_PROTOCOL))
            except OSError:
                pass
        deadline = time.monotonic() + 5.0
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.terminate()
                p.join(2.0)
            if p.is_alive():
                p.kill()
                p.join(2.0)
        for c in self.conns:
            c.close()
        self._death_writer.close()
        logger.info("executor %s shut down", self.name)


class _ReplyFuture(Future):
    """The future of a non-blocking call: result() reads the pipe up to this call's reply."""

    def __init__(self, executor: MultiprocExecutor) -> None:
        super().__init__()
        self._executor = executor

    def result(self, timeout: float | None = None):
        if not self.done():
            self._executor._read_pending(until=self)
        return super().result(timeout)
