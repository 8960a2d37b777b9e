"""Entry point of a worker process (multiproc and tensor-parallel executors).

Control flow per call: the driver sends (method, args) to rank 0 over a pipe; with more than
one rank, rank 0 broadcasts it to the others over torch.distributed (a gloo group, so it also
reaches ranks on other machines); every rank runs it; rank 0 replies ("OK", result) or
("FAILURE", message). A rank that fails mid-collective exits non-zero rather than leave the
others waiting; the driver watches every local process and fails fast.
"""
from __future__ import annotations

import logging
import os
import pickle
import signal
import sys
import threading
import traceback

READY, OK, FAILURE = "READY", "OK", "FAILURE"


def name_os_thread(name: str) -> None:
    """Give the calling thread an OS name, what top -H and /proc/PID/task/TID/comm show (on the
    main thread: the process' name, what top and `ps -o comm` show), so each of llmsvc's
    processes and threads can be told apart and its CPU time read. Linux only; a no-op elsewhere."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as f:
            f.write(name[:15])  # the kernel keeps 15 bytes
    except OSError:
        pass


def watch_parent(death_reader) -> None:
    """Exit as soon as the driver dies: its end of the death pipe closes and recv() raises EOF."""
    try:
        death_reader.recv()
    except (EOFError, OSError):
        pass
    os._exit(1)


def _broadcast(box: list, group, log) -> None:
    """broadcast_object_list from rank 0; a peer that went away (node 0 died, a rank was killed)
    ends this process with exit code 1 instead of a traceback from inside the collective."""
    import torch.distributed as dist

    try:
        dist.broadcast_object_list(box, src=0, group=group)
    except Exception as e:  # noqa: BLE001 - gloo raises RuntimeError on a closed connection
        log.error("lost the process group (a peer rank or node 0 went away): %s", str(e).splitlines()[0])
        os._exit(1)


def worker_main(config, rank: int, world_size: int, local_rank: int, init_method: str,
                conn, death_reader, num_threads: int, log_level: int) -> None:
    logging.basicConfig(level=log_level, stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s [rank{rank}] %(name)s: %(message)s")
    log = logging.getLogger("llmsvc.worker")
    # a stop signal sent to the whole process group is the server's to act on: it drains, then
    # shuts its workers down (or the death pipe ends them when it is gone)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    if death_reader is not None:
        threading.Thread(target=watch_parent, args=(death_reader,), daemon=True).start()
    import torch

    torch.set_num_threads(num_threads)
    from llmsvc.worker.worker import Worker

    try:
        worker = Worker(config, rank=rank, world_size=world_size,
                        distributed_init_method=init_method, local_rank=local_rank)
        worker.init_device()
        worker.load_model()
    except BaseException:
        msg = traceback.format_exc()
        log.error("worker failed to start:\n%s", msg)
        if conn is not None:
            conn.send((FAILURE, msg))
        os._exit(1)
    if conn is not None:
        conn.send((READY, os.getpid()))
    group = worker.cpu_group if world_size > 1 else None
    while True:
        if rank == 0:
            try:
                call = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                os._exit(1)
            if world_size > 1:
                if call[0] == "execute_model":  # the other ranks cannot fill async placeholders
                    worker.fill_placeholders(call[1][0])
                _broadcast([call], group, log)
        else:
            box = [None]
            _broadcast(box, group, log)
            call = box[0]
        method, args = call
        if method == "abandon":  # node 0's engine failed: the group ends as a failure on every node
            log.error("node 0 abandoned the group after a failed call; exiting")
            os._exit(1)
        try:
            result = getattr(worker, method)(*args)
        except BaseException:
            msg = traceback.format_exc()
            log.error("%s failed:\n%s", method, msg)
            if rank == 0:
                conn.send((FAILURE, msg))
            if world_size > 1 or method == "shutdown":
                os._exit(1)  # peers may be blocked in a collective: die loudly instead
            continue
        if rank == 0:
            conn.send_bytes(pickle.dumps((OK, result), protocol=pickle.HIGHEST_PROTOCOL))
        if method == "shutdown":
            break
    os._exit(0)
