"""Each system measured alone on the box: the peer frozen while ours runs, an idle check first.

A peer's children (vLLM's server or offline engine, each in its own process group) stay up
between runs, since they take over a minute to start. Idle as they look, they are not silent: a
server's worker polls, its front end keeps timers, and on a 2-vCPU box any of that lands in our
queue. So while one of our systems is measured every peer group is stopped (SIGSTOP to the
group: the engine core is a grandchild), and resumed (SIGCONT) before the peer's own run. Our
own systems are either gone during a peer's run (a fresh engine or server per run, shut down
after it) or an external --server that the bench cannot stop.

Before each run the box must look idle: the CPU time /proc/stat counts as busy (all but idle
and iowait) over about a second, below a threshold, waiting a bounded time for it; what was
seen is printed with the run, so a run measured on a busy box says so.
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

IDLE_BUSY = 0.15  # the box counts as idle below this fraction of all CPUs busy
# how long to wait for it before measuring anyway; LLMSVC_BENCH_IDLE_WAIT sets the default of
# --idle-wait (the tests set -1: they time nothing, and their own processes keep the box busy)
IDLE_WAIT_S = float(os.environ.get("LLMSVC_BENCH_IDLE_WAIT", "30"))
SAMPLE_S = 1.0  # one /proc/stat sample spans this long


def read_proc_stat() -> str:
    with open("/proc/stat") as f:
        return f.read()


def cpu_times(stat_text: str) -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs from /proc/stat's "cpu" line: busy is everything but
    idle and iowait (user, nice, system, irq, softirq, steal)."""
    for line in stat_text.splitlines():
        if line.startswith("cpu "):
            fields = [int(x) for x in line.split()[1:]]
            total = sum(fields[:8])  # guest and guest_nice are already in user and nice
            idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
            return total - idle, total
    raise ValueError("no aggregate cpu line in /proc/stat")


@dataclass
class IdleCheck:
    busy: float  # fraction of all CPUs busy in the last sample
    waited_s: float  # how long the check waited for an idle box
    idle: bool  # whether that sample was below the threshold
    checked: bool = True  # False: the check was turned off (--idle-wait below 0)

    def line(self, threshold: float = IDLE_BUSY) -> str:
        if not self.checked:
            return "idle check off"
        state = "idle" if self.idle else f"NOT idle after waiting {self.waited_s:.0f}s, measured anyway"
        waited = f" after {self.waited_s:.0f}s" if self.idle and self.waited_s >= 1 else ""
        return f"box {state}: CPU {100 * self.busy:.0f}% busy over {SAMPLE_S:.0f}s (threshold {100 * threshold:.0f}%){waited}"


def sample_busy(read: Callable[[], str] = read_proc_stat, sleep: Callable[[float], None] = time.sleep,
                interval: float = SAMPLE_S) -> float:
    """Fraction of all CPUs' time busy over `interval` (0 when no time passed)."""
    b0, t0 = cpu_times(read())
    sleep(interval)
    b1, t1 = cpu_times(read())
    return (b1 - b0) / (t1 - t0) if t1 > t0 else 0.0


def wait_idle(threshold: float = IDLE_BUSY, timeout: float = IDLE_WAIT_S,
              read: Callable[[], str] = read_proc_stat, sleep: Callable[[float], None] = time.sleep,
              clock: Callable[[], float] = time.monotonic, interval: float = SAMPLE_S) -> IdleCheck:
    """Sample until one sample is below `threshold` or `timeout` seconds have passed (at least
    one sample either way); a negative timeout turns the check off."""
    if timeout < 0:
        return IdleCheck(0.0, 0.0, True, checked=False)
    start = clock()
    while True:
        busy = sample_busy(read, sleep, interval)
        waited = clock() - start
        if busy < threshold or waited >= timeout:
            return IdleCheck(busy, waited, busy < threshold)


def mem_available_gib(read: Callable[[], str] = lambda: open("/proc/meminfo").read()) -> Optional[float]:
    """MemAvailable from /proc/meminfo in GiB (None where it cannot be read). Printed with each
    idle check: a frozen peer still holds its memory, and a run that must reclaim pages to fault
    in its KV cache stalls."""
    try:
        for line in read().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / (1 << 20)  # kB
    except (OSError, ValueError, IndexError):
        pass
    return None


def signal_group(pgid: int, sig: int) -> bool:
    """Send sig to a process group; False when it is gone (or not ours)."""
    try:
        os.killpg(pgid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def freeze(pgids: Iterable[int]) -> list[int]:
    """SIGSTOP each group; returns those that were stopped."""
    return [g for g in pgids if signal_group(g, signal.SIGSTOP)]


def resume(pgids: Iterable[int]) -> None:
    for g in pgids:
        signal_group(g, signal.SIGCONT)


@contextlib.contextmanager
def frozen(pgids: Iterable[int]):
    """The groups stopped inside the block, resumed on the way out (exceptions included)."""
    stopped = freeze(pgids)
    try:
        yield stopped
    finally:
        resume(stopped)


@dataclass(frozen=True)
class HeldGroup:
    """`llmsvc bench --freeze NAMES=PID`: the process group of PID, which the bench did not start
    (a server, a gateway and its worker started together under `setsid`), kept running while
    the systems NAMES run and stopped while any other system runs."""
    names: frozenset[str]
    pgid: int


def parse_held(text: str) -> HeldGroup:
    """argparse type of --freeze: `NAME[,NAME...]=PID` with PID alive and outside the bench's own
    process group (stopping that group would stop the bench itself)."""
    import argparse

    names, sep, pid = text.rpartition("=")
    names_set = frozenset(n.strip() for n in names.split(",") if n.strip())
    if not sep or not names_set or not pid.strip().isdigit():
        raise argparse.ArgumentTypeError(f"--freeze {text!r}: expected NAME[,NAME...]=PID")
    try:
        pgid = os.getpgid(int(pid))
    except ProcessLookupError:
        raise argparse.ArgumentTypeError(f"--freeze {text!r}: no process {pid.strip()}") from None
    if pgid == os.getpgrp():
        raise argparse.ArgumentTypeError(f"--freeze {text!r}: process {pid.strip()} is in the bench's own process "
                                         "group; start it in a group of its own (setsid)")
    return HeldGroup(names_set, pgid)


def check_held(held: Iterable[HeldGroup], endpoint_names: Iterable[str]) -> Optional[str]:
    """Why --freeze names a system the bench will not run (the message for exit code 2), or None."""
    known = {"llmsvc", "vllm", "hf", *endpoint_names}
    unknown = sorted(n for h in held for n in h.names if n not in known)
    return (f"--freeze: no system named {unknown[0]!r} (llmsvc, vllm, hf or an --openai name)"
            if unknown else None)


def system_name(key: str) -> str:
    """The name --freeze gives a System key: llmsvc (its gRPC and offline runs), an --openai
    endpoint's NAME, or the peer's key (vllm, hf)."""
    if key in ("serve", "offline"):
        return "llmsvc"
    return key.split(":", 1)[1] if key.startswith("openai:") else key


class Turns:
    """The `before` hook of repeat.alternate: freezes the peer groups before a run of ours,
    resumes them before a peer's, then waits for an idle box and prints what it saw.

    peer_groups() -> the process groups up now (they change as a peer starts its offline engine
    or its server); peer_keys: the System keys that are peers; held: groups the bench did not
    start, each running only for the systems it names."""

    def __init__(self, peer_groups: Callable[[], list[int]], peer_keys: set[str],
                 idle: Callable[[], IdleCheck] = wait_idle, out: Callable[[str], None] = print,
                 threshold: float = IDLE_BUSY, memory: Callable[[], Optional[float]] = mem_available_gib,
                 held: Iterable[HeldGroup] = ()) -> None:
        self.peer_groups, self.peer_keys, self.idle, self.out = peer_groups, peer_keys, idle, out
        self.threshold = threshold  # the one `idle` applies, for the printed line
        self.memory = memory
        self.held = list(held)
        self.frozen: list[int] = []
        self.checks: list[IdleCheck] = []

    def before(self, key: str, label: str) -> IdleCheck:
        name = system_name(key)
        running = {h.pgid for h in self.held if name in h.names}
        want = [h.pgid for h in self.held if h.pgid not in running]  # stopped for this run
        if key not in self.peer_keys:
            want += [g for g in self.peer_groups() if g not in running]
        resume([g for g in self.frozen if g not in want])
        self.frozen = [g for g in self.frozen if g in want]
        self.frozen += freeze([g for g in dict.fromkeys(want) if g not in self.frozen])
        check = self.idle()
        self.checks.append(check)
        held = f"; peer frozen ({len(self.frozen)} process group{'s' * (len(self.frozen) != 1)})" if self.frozen else ""
        mem = self.memory()
        free = f"; {mem:.1f} GiB memory available" if mem is not None else ""
        self.out(f"  [{label}] {check.line(self.threshold)}{free}{held}")
        return check

    def resume(self) -> None:
        resume(self.frozen)
        self.frozen = []


def peer_pgids(procs: Iterable[Optional[subprocess.Popen]]) -> list[int]:
    """Process groups of the live children among procs (subprocess.Popen started with
    start_new_session=True, so each one's pid is its group)."""
    return [p.pid for p in procs if p is not None and p.poll() is None]


def warmup_prompts(prompts: list[list[int]], count: int = 8) -> list[list[int]]:
    """The warm-up each system runs before its clock starts: the first `count` prompts reversed,
    for 2 tokens. A step of the workload's shape (as many prompt rows, then a decode of as many
    sequences) whose first blocks are, but for chance, no measured prompt's, so it leaves
    nothing in a prefix cache (whole blocks of tokens) that the measured run could hit."""
    return [list(reversed(p)) for p in prompts[:count]]
