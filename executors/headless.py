"""Headless node of a multi-node tensor-parallel group: this machine's ranks, no server, no engine.

Node 0 (`--node-rank 0`) runs the gRPC server, the engine and ranks [0, N/nnodes); node k runs
ranks [k*N/nnodes, (k+1)*N/nnodes) here. All ranks meet in one torch.distributed group through
`tcp://master_addr:master_port` (node 0's rank 0 hosts the store). Node 0's rank 0 broadcasts each
call to every rank, so this process only starts its workers and watches them:
- node 0 shuts down gracefully -> our workers get the "shutdown" call and exit 0 -> exit code 0;
- node 0's engine failed (a call failed or timed out) -> they get "abandon" and exit 1 -> exit code 1;
- node 0 dies -> our workers' next collective fails, they exit non-zero -> exit code 1
  (an orchestrator restarts this node, as it restarts node 0);
- `stop` set (SIGTERM) -> our workers are stopped -> exit code 0 (node 0 then fails and exits 1);
- node 0's rendezvous store (in its rank 0) stops accepting connections while ours still run ->
  exit code 1. A rank stalled (a frozen VM) when node 0 went away can wait in a gloo collective
  that never returns; this catches it.
"""
from __future__ import annotations

import logging
import multiprocessing.connection as mpc
import socket
import threading
import time

from executors.tensor_parallel import TensorParallelExecutor
from llmsvc.config import EngineConfig

logger = logging.getLogger(__name__)

STORE_CHECK_S = 2.0  # how often node 0's store is probed
STORE_MISSES = 3  # consecutive refused probes that mean node 0 is gone


def store_answers(addr: str, port: int) -> bool:
    """Whether node 0's TCPStore accepts a connection (it ignores one closed at once)."""
    try:
        with socket.create_connection((addr, port), timeout=5.0):
            return True
    except OSError:
        return False


def run_headless(config: EngineConfig, stop: threading.Event | None = None) -> int:
    """Start this node's ranks and block until they exit (or `stop` is set). Returns an exit code."""
    from llmsvc.models.resolve import resolve_model_config

    pc = config.parallel_config
    if pc.nnodes < 2 or not 0 < pc.node_rank < pc.nnodes:
        raise ValueError(f"a headless node needs nnodes >= 2 and 0 < node_rank < nnodes "
                         f"(got nnodes={pc.nnodes}, node_rank={pc.node_rank})")
    if not pc.master_port:
        raise ValueError("a headless node needs --master-port (node 0's rendezvous port)")
    stop = stop or threading.Event()
    config = config.replace(model_config=resolve_model_config(config.model_config))
    executor = TensorParallelExecutor(config)
    logger.info("headless node %d/%d: ranks %s of %d ready, driven by node 0 at %s:%d", pc.node_rank,
                pc.nnodes, executor.ranks, executor.world_size, pc.master_addr, pc.master_port)
    try:
        sentinels = [p.sentinel for p in executor.procs]
        misses, next_check = 0, time.monotonic() + STORE_CHECK_S
        while not stop.is_set():
            if mpc.wait(sentinels, timeout=0.5):
                break
            if time.monotonic() >= next_check:
                misses = 0 if store_answers(pc.master_addr, pc.master_port) else misses + 1
                next_check = time.monotonic() + STORE_CHECK_S
                if misses >= STORE_MISSES:
                    logger.error("headless node %d: node 0's store at %s:%d stopped answering (node 0 is "
                                 "gone); exiting", pc.node_rank, pc.master_addr, pc.master_port)
                    return 1
        if stop.is_set():
            logger.info("headless node %d: stopping its workers", pc.node_rank)
            return 0
        deadline = time.monotonic() + 5.0  # the others follow when the group is gone
        for p in executor.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        codes = [p.exitcode for p in executor.procs]
        if all(c == 0 for c in codes):
            logger.info("headless node %d: node 0 shut the group down; exiting", pc.node_rank)
            return 0
        logger.error("headless node %d: worker exit codes %s (node 0 gone or a rank failed); exiting",
                     pc.node_rank, codes)
        return 1
    finally:
        executor.shutdown()
