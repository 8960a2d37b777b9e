"""Burst wait: after an idle spell, a core loop takes the requests of a burst before its first step.

A client submitting a batch over gRPC delivers it over milliseconds (W1 and W2 on the 2-core
box: 0.3-1.7 ms apart). Stepping at the first request ran it alone (a 128-token prefill of
~250 ms there) while the others queued behind it, and split the rest over more, smaller steps.
So a loop that was idle keeps taking requests while they arrive within a gap of each other, and
steps when a gap passes without one, after 10 gaps in all, or once a step's token budget or
max_num_seqs is queued. The gap is `burst_wait_ms`, or 2% of what a step of the requests queued
so far would take (the core's seconds_per_token, once a prefill-sized step has run) if less:
where steps are cheap (a GPU) a lone request barely waits; a busy core never waits.

Both core loops use it, through `gather`: the engine-core process (proc.py, waiting on its
ZeroMQ socket) and the front end's thread driving an inline core (llmsvc/engine/engine_thread.py,
waiting on its condition). Both also check their workers' health when idle, every
IDLE_HEALTH_CHECK_S: a worker that dies while nothing runs is noticed within that.
"""
from __future__ import annotations

import time
from typing import Callable

GAP_SHARE = 0.02  # of the queued requests' step time: what a lone request may wait
MAX_GAPS = 10
IDLE_HEALTH_CHECK_S = 1.0  # an idle core loop checks its executor's health this often


class BurstWindow:
    """One burst's bookkeeping; the loop owns the waiting. Not thread-safe (one loop's own)."""

    def __init__(self, burst_wait_ms: float, max_num_batched_tokens: int, max_num_seqs: int) -> None:
        self.burst_wait_s = max(0.0, burst_wait_ms / 1e3)
        self.budget = (max_num_batched_tokens, max_num_seqs)
        self.tokens = self.seqs = 0  # prompt tokens and requests queued since the burst began
        self.gap = self.deadline = 0.0

    def reset(self) -> None:
        """A new loop iteration: nothing queued yet."""
        self.tokens = self.seqs = 0

    def add(self, num_prompt_tokens: int) -> None:
        self.tokens += num_prompt_tokens
        self.seqs += 1

    def start(self, now: float, seconds_per_token: float | None) -> bool:
        """The loop was idle and has just queued the burst's first requests: whether to wait for
        more (False: the wait is off, or nothing was queued). Fixes the gap and the deadline."""
        if self.burst_wait_s <= 0 or self.seqs == 0:
            return False
        self.gap = self.burst_wait_s
        if seconds_per_token is not None:
            self.gap = min(self.gap, GAP_SHARE * seconds_per_token * self.tokens)
        self.deadline = now + MAX_GAPS * self.gap
        return True

    def wait_s(self, now: float) -> float:
        """How long to wait for the next request of the burst; 0: step now (budget queued or the
        deadline passed). A wait that ends with no request also means: step now."""
        if self.tokens >= self.budget[0] or self.seqs >= self.budget[1]:
            return 0.0
        return max(0.0, min(self.gap, self.deadline - now))

    def gather(self, seconds_per_token: float | None, wait: Callable[[float], bool],
               take: Callable[[], bool]) -> bool:
        """The loop was idle and queued the burst's first requests (add): take the rest of the
        burst. `wait(s)` waits up to s seconds for input and says whether any came; `take()`
        applies what came (calling add) and returns True to stop at once (a shutdown).
        Returns take's True; False when the burst is over and the loop should step."""
        if not self.start(time.monotonic(), seconds_per_token):
            return False
        while (w := self.wait_s(time.monotonic())) > 0:
            if not wait(w):
                return False
            if take():
                return True
        return False
