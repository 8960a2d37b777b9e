"""What the soak reads off the server: the RSS of its processes, whether it is idle with every
block of both pools free (GetServerInfo), and its swap-out/in counters (/metrics)."""
from __future__ import annotations

import os
import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from llmsvc.v1 import llmsvc_pb2 as pb

SWAP_COUNTERS = ("llmsvc_num_swap_outs_total", "llmsvc_num_swap_ins_total")


def _proc_rss_bytes(pid: int) -> int:
    """Linux /proc fallback when psutil is not installed."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/statm") as f:
                total += int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
            for t in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{t}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except (OSError, ValueError):
            pass
    return total


def rss_bytes(pid: int) -> int:
    """Resident memory of `pid` and all its descendants (0 if it is gone)."""
    try:
        import psutil
    except ImportError:
        return _proc_rss_bytes(pid)
    try:
        p = psutil.Process(pid)
        procs = [p] + p.children(recursive=True)
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for q in procs:
        try:
            total += q.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def swap_counters(url: str | None) -> dict[str, int] | None:
    """{"swap_outs", "swap_ins"} from the server's /metrics (None: no URL, no answer, or no swap space)."""
    if not url:
        return None
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            text = r.read().decode()
    except OSError:  # a sample goes without; the summary then says the count is unknown
        return None
    # counters are exposed as <name>_total samples of families named without the suffix
    found = {s.name: int(s.value) for fam in text_string_to_metric_families(text)
             for s in fam.samples if s.name in SWAP_COUNTERS}
    if len(found) < len(SWAP_COUNTERS):
        return None
    return {"swap_outs": found[SWAP_COUNTERS[0]], "swap_ins": found[SWAP_COUNTERS[1]]}


def is_idle(info: pb.GetServerInfoResponse) -> bool:
    """Nothing in flight and every block of both pools free (cached prefix blocks count as free)."""
    return (info.num_free_kv_blocks == info.num_kv_blocks and info.num_running == 0 and info.num_waiting == 0
            and info.num_swapped == 0 and info.num_free_swap_blocks == info.num_swap_blocks)


def wait_idle(stub, timeout: float = 120.0) -> pb.GetServerInfoResponse:
    end = time.monotonic() + timeout
    while True:
        info = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
        if is_idle(info) or time.monotonic() > end:
            return info
        time.sleep(0.2)
