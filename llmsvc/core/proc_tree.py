"""The processes below a process (Linux /proc; elsewhere none are found), for a shutdown that
must not leave any behind: a worker stopped by SIGSTOP, or hung, cannot follow its parent out
through its death pipe, so whoever kills the parent kills these too."""
from __future__ import annotations

import os
import signal


def descendants(pid: int) -> list[int]:
    """Every live descendant of `pid`, parents before children."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop(0)
        for task in _listdir(f"/proc/{p}/task"):
            try:
                with open(f"/proc/{p}/task/{task}/children") as f:
                    kids = [int(x) for x in f.read().split()]
            except OSError:
                continue
            for k in kids:
                if k not in out:
                    out.append(k)
                    todo.append(k)
    return out


def kill_all(pids: list[int]) -> int:
    """SIGKILL each of `pids` still alive (a stopped process dies too); returns how many were."""
    killed = 0
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
            killed += 1
        except (ProcessLookupError, PermissionError):
            pass
    return killed


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []
