"""The CPU KV cache's host memory (llmsvc/worker/kv_memory.py): zero tensors on an anonymous
mapping, faulted in by an idle-priority thread that never changes a byte."""
from __future__ import annotations

import os
import platform
import sys
import threading

import pytest
import torch

from llmsvc.worker import kv_memory
from llmsvc.worker.kv_memory import KVHostPool, Prefaulter

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_POPULATE_WRITE is Linux's")


def _kernel_has_populate() -> bool:
    major, minor = (int(x) for x in platform.release().split(".")[:2])
    return (major, minor) >= (5, 14)


def _resident_bytes(address: int) -> int:
    """Rss of the mapping of this process that contains `address` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "Rss:":
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pool_tensors_are_zero_disjoint_and_page_aligned(dtype):
    shape = (5, 16, 3, 7)  # 1680 elements: not a whole number of pages
    pool = KVHostPool(6, shape, dtype, prefault=False)
    assert len(pool.tensors) == 6
    for t in pool.tensors:
        assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
        assert t.data_ptr() % os.sysconf("SC_PAGE_SIZE") == 0
        assert not t.any()
    for i, t in enumerate(pool.tensors):
        t.fill_(i + 1)
    for i, t in enumerate(pool.tensors):
        assert torch.equal(t, torch.full(shape, i + 1, dtype=dtype))
    pool.close()


def test_tensors_keep_the_mapping_alive():
    pool = KVHostPool(2, (64, 1024), torch.float32, prefault=False)
    k = pool.tensors[1]
    k.fill_(3.0)
    del pool
    import gc
    gc.collect()
    assert float(k.sum()) == 3.0 * 64 * 1024  # still mapped: the tensor holds the buffer


@linux
def test_prefault_makes_the_pool_resident():
    pool = KVHostPool(8, (8 << 20,), torch.uint8)  # 64 MiB
    assert pool.prefaulter.done.wait(60)
    if not _kernel_has_populate():
        assert pool.prefaulter.supported is False
        return
    assert pool.prefaulter.supported is True
    assert pool.prefaulter.populated_bytes == pool.nbytes
    assert _resident_bytes(pool.address) >= pool.nbytes
    assert not any(t.any() for t in pool.tensors)  # populating wrote nothing


@linux
def test_prefault_keeps_what_the_model_writes_meanwhile(monkeypatch):
    monkeypatch.setattr(kv_memory, "CHUNK_BYTES", 1 << 20)  # many calls, so the writes interleave
    n, rows = 32, 1 << 20
    pool = KVHostPool(n, (rows,), torch.uint8)  # 32 MiB, written from the far end while populating
    for i in reversed(range(n)):
        pool.tensors[i][::4096].fill_(i + 1)  # one byte per page, as a step writes K/V rows
    assert pool.prefaulter.done.wait(60)
    for i, t in enumerate(pool.tensors):
        assert torch.all(t[::4096] == i + 1)
        assert int(t.sum()) == (i + 1) * (rows // 4096)  # and nothing else changed


def test_stop_joins_the_thread(monkeypatch):
    monkeypatch.setattr(kv_memory, "CHUNK_BYTES", 1 << 16)
    pool = KVHostPool(4, (16 << 20,), torch.uint8)
    pool.close()
    assert pool.prefaulter.done.is_set()
    assert not any(t.name == "llmsvc-kv-prefault" and t.is_alive() and t is pool.prefaulter._thread
                   for t in threading.enumerate())


def test_a_failed_madvise_stops_quietly():
    address = 4096  # never mapped: madvise fails (ENOMEM), nothing is touched
    p = Prefaulter(address, 1 << 20)
    assert p.done.wait(10)
    assert p.supported is False and p.populated_bytes == 0
