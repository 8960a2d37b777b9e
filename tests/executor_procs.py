"""Process helpers for executor tests: a real `python -m llmsvc serve` subprocess, its worker
processes, and the /dev/shm entries a process tree owns."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time

from llmsvc.core.proc_tree import _listdir, descendants  # noqa: F401 - tests import it from here

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def llmsvc_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "llmsvc", *args]


def subprocess_env() -> dict:
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("LLMSVC_AUTH_TOKENS", None)
    return env


class LoggedProcess:
    """A subprocess whose stderr is collected line by line (on a thread) into `lines`."""

    def __init__(self, cmd: list[str]) -> None:
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=subprocess_env(), stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True)
        self.pid = self.proc.pid
        self.lines: list[str] = []
        self._cond = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            with self._cond:
                self.lines.append(line)
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def wait_for(self, pattern: str, timeout: float = 120.0) -> re.Match:
        """First log line matching `pattern` (AssertionError with the log tail on timeout/exit)."""
        deadline = time.monotonic() + timeout
        rx = re.compile(pattern)
        seen = 0
        with self._cond:
            while True:
                for line in self.lines[seen:]:
                    m = rx.search(line)
                    if m:
                        return m
                seen = len(self.lines)
                left = deadline - time.monotonic()
                if left <= 0 or (self.proc.poll() is not None and not self._reader_alive()):
                    raise AssertionError(f"no log line matching {pattern!r}:\n{self.log_tail()}")
                self._cond.wait(min(left, 0.5))

    def _reader_alive(self) -> bool:
        return not self.proc.stderr.closed and self.proc.poll() is None

    def log_tail(self, n: int = 40) -> str:
        return "".join(self.lines[-n:])

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def _spawned(pid: int) -> list[tuple[int, str]]:
    """(pid, comm) of the spawned multiprocessing descendants of `pid` (not the resource tracker)."""
    out = []
    for p in descendants(pid):
        try:
            with open(f"/proc/{p}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ")
            with open(f"/proc/{p}/comm") as f:
                comm = f.read().strip()
        except OSError:
            continue
        if b"multiprocessing.spawn" in cmd:
            out.append((p, comm))
    return out


def worker_pids(pid: int) -> list[int]:
    """Descendants of `pid` that are executor worker processes, in start order (the engine-core
    process, also a spawned child, names itself llmsvc-core and is left out)."""
    return [p for p, comm in _spawned(pid) if comm != "llmsvc-core"]


def core_pids(pid: int) -> list[int]:
    """Descendants of `pid` that are engine-core processes (`llmsvc serve --engine-core process`)."""
    return [p for p, comm in _spawned(pid) if comm == "llmsvc-core"]


def alive(pid: int) -> bool:
    """True unless gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_gone(pids, timeout: float = 10.0) -> list[int]:
    """Wait until none of `pids` is alive; return those still alive at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        left = [p for p in pids if alive(p)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def shm_entries() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


def open_shm_of(pids) -> set[str]:
    """/dev/shm paths that any of `pids` has open or mapped right now."""
    found = set()
    for p in pids:
        for path in (f"/proc/{p}/maps",):
            try:
                with open(path) as f:
                    found |= {line.split(None, 5)[-1].strip() for line in f if "/dev/shm/" in line}
            except OSError:
                pass
        for fd in _listdir(f"/proc/{p}/fd"):
            try:
                target = os.readlink(f"/proc/{p}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("/dev/shm/"):
                found.add(target)
    return {s.replace(" (deleted)", "") for s in found}


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def serve_tiny(model_dir: str, *extra: str, timeout: float = 180.0):
    """`python -m llmsvc serve` of a tiny model on 127.0.0.1 (any free port), once "ready";
    returns (LoggedProcess, grpc channel to it)."""
    import grpc

    srv = LoggedProcess(llmsvc_cmd("serve", model_dir, "--host", "127.0.0.1", "--port", "0", "--device", "cpu",
                                   "--max-model-len", "4096", "--kv-cache-memory", "8MiB", *extra))
    port = int(srv.wait_for(r"listening on 127\.0\.0\.1:(\d+)").group(1))
    srv.wait_for(r"ready: serving", timeout=timeout)
    return srv, grpc.insecure_channel(f"127.0.0.1:{port}")
