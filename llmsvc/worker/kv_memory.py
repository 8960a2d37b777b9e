"""Host memory for a CPU worker's KV cache: zero pages from the kernel, faulted in off the start-up path.

`torch.zeros` of a 2 GiB pool writes every page before the engine reports ready: half a million
first-touch page faults, 1.3-5 s of system time on a 2-vCPU VM where the hypervisor backs guest
memory on first use. An anonymous mapping is zero by contract, so the pool needs no write at
all: `KVHostPool` maps it and starts a `Prefaulter`, which asks the kernel to fault the
pages in (MADV_POPULATE_WRITE, Linux 5.14+) from an idle-priority thread, a chunk at a time.
That never changes a byte, so it may run while the model writes K/V into the same pages; the
pages a step touches before the prefaulter reaches them fault in as usual. Where the kernel
lacks the advice the pool simply faults in as it is used.

The worker then waits for the prefaulter at the end of its warm-up (`wait_resident`), while
nothing else runs: a server's first requests, and a bench's first run, ran 10-35% slower while
the prefaulter and their own first-touch faults competed with them on a 2-vCPU box.
LLMSVC_KV_PREFAULT=background skips the wait (the engine reports ready sooner and its first
steps share the CPU with the prefaulter).
"""
from __future__ import annotations

import ctypes
import logging
import mmap
import os
import threading
import time

import torch

logger = logging.getLogger(__name__)

MADV_POPULATE_WRITE = 23  # <linux/mman.h>, Linux 5.14+
CHUNK_BYTES = 32 << 20  # one madvise call; the prefaulter checks for stop() between calls
_PAGE = mmap.PAGESIZE
PREFAULT_WAIT_S = 120.0  # bound on the start-up wait (a 2 GiB pool took 1.3-5 s on 2 vCPUs)


class Prefaulter:
    """Faults in [address, address + nbytes) on a SCHED_IDLE thread. `keepalive` (the mapping)
    is referenced until the thread ends, so the range cannot be unmapped under a call."""

    def __init__(self, address: int, nbytes: int, keepalive: object = None) -> None:
        self.address, self.nbytes = address, nbytes
        self._keepalive = keepalive
        self.done = threading.Event()  # set when the whole range is resident or the thread gave up
        self.populated_bytes = 0
        self.supported: bool | None = None  # None until the first madvise answered
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="llmsvc-kv-prefault", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        t0 = time.perf_counter()
        try:
            _idle_priority()
            libc = ctypes.CDLL(None, use_errno=True)
            madvise = libc.madvise
            madvise.argtypes, madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
            off = 0
            while off < self.nbytes and not self._stop.is_set():
                n = min(CHUNK_BYTES, self.nbytes - off)
                if madvise(self.address + off, n, MADV_POPULATE_WRITE) != 0:  # the GIL is released here
                    err = ctypes.get_errno()
                    self.supported = self.supported or False  # True stays: earlier chunks took
                    logger.debug("KV cache prefault stopped at %d MiB: %s", off >> 20, os.strerror(err))
                    return
                self.supported = True
                off += n
                self.populated_bytes = off
            if off >= self.nbytes:
                logger.debug("KV cache: %d MiB faulted in by the prefault thread in %.1fs",
                             self.nbytes >> 20, time.perf_counter() - t0)
        except (OSError, AttributeError):  # no libc madvise (not Linux/glibc): pages fault in on use
            self.supported = False
        finally:
            self._keepalive = None
            self.done.set()

    def stop(self) -> None:
        """Stop after the chunk in flight and join the thread (call before unmapping)."""
        self._stop.set()
        self._thread.join()


def _idle_priority() -> None:
    """This thread runs only when a CPU would otherwise idle (SCHED_IDLE; nice 19 where refused)."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # pid 0: the calling thread
    except (AttributeError, OSError):
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except (AttributeError, OSError):
            pass


class KVHostPool:
    """One anonymous mapping carved into `count` zero-filled tensors of `shape` and `dtype`, each
    starting on a page boundary. Each tensor keeps the mapping referenced (torch.frombuffer), so
    it is unmapped only when the pool and every tensor are gone; close() stops the prefaulter."""

    def __init__(self, count: int, shape: tuple[int, ...], dtype: torch.dtype, prefault: bool = True) -> None:
        per = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        stride = -(-per // _PAGE) * _PAGE
        self.nbytes = max(stride * count, _PAGE)
        self._map = mmap.mmap(-1, self.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        flat = torch.frombuffer(self._map, dtype=torch.uint8)  # [nbytes]; keeps the mapping referenced
        self.tensors = [flat[i * stride:i * stride + per].view(dtype).view(shape) for i in range(count)]
        self.address = flat.data_ptr()
        self.prefaulter = Prefaulter(self.address, self.nbytes, self._map) if prefault else None

    def wait_resident(self, timeout: float = PREFAULT_WAIT_S) -> bool:
        """Block until the prefaulter is done (or `timeout` seconds), unless LLMSVC_KV_PREFAULT is
        "background". True when it finished (also when it gave up: pages then fault on use)."""
        if self.prefaulter is None or os.environ.get("LLMSVC_KV_PREFAULT", "wait") == "background":
            return self.prefaulter is None or self.prefaulter.done.is_set()
        t0 = time.perf_counter()
        done = self.prefaulter.done.wait(timeout)
        logger.debug("KV cache: waited %.1fs for the prefault thread (%s)", time.perf_counter() - t0,
                     "done" if done else "still running")
        return done

    def close(self) -> None:
        """Stop the prefault thread; the mapping goes when the last tensor viewing it does."""
        if self.prefaulter is not None:
            self.prefaulter.stop()
