"""One request's bounded output stream between the engine thread and its asyncio consumer.

Lives on the event loop (only touched from loop callbacks and the consumer). Invariant:
at most ONE pending RequestOutput per request: a new delta arriving while the consumer has
not taken the previous one is merged into it (text, token ids and logprobs concatenated per
index). So a slow reader costs memory proportional to the unsent text, never a queue of
messages, and the engine never waits on a client. Torch-free.
"""
from __future__ import annotations

import asyncio
import copy
import dataclasses
import time

from llmsvc.outputs import CompletionOutput, RequestOutput

_BYTES_PER_TOKEN_ID = 4
_BYTES_PER_LOGPROB = 16


def _completion_bytes(c: CompletionOutput) -> int:
    n = len(c.text.encode("utf-8", "surrogatepass")) + _BYTES_PER_TOKEN_ID * len(c.token_ids)
    if c.logprobs:
        n += sum(_BYTES_PER_LOGPROB * max(1, len(d)) for d in c.logprobs)
    return n


def output_nbytes(out: RequestOutput) -> int:
    """Rough wire size of what `out` adds to a stream's backlog."""
    return sum(_completion_bytes(c) for c in out.outputs)


# a DELTA CompletionOutput's fields other than the appended ones (text, token_ids, logprobs) and
# its index are cumulative or final values: the newer output's replace the pending one's
_LATEST_WINS = tuple(f.name for f in dataclasses.fields(CompletionOutput)
                     if f.name not in ("index", "text", "token_ids", "logprobs"))


def merge_delta(pending: RequestOutput, new: RequestOutput) -> None:
    """Fold the DELTA output `new` into the not-yet-consumed `pending` (same request), in place."""
    by_index = {c.index: c for c in pending.outputs}
    for c in new.outputs:
        old = by_index.get(c.index)
        if old is None:
            c = copy.copy(c)
            c.token_ids = list(c.token_ids)
            c.logprobs = list(c.logprobs) if c.logprobs is not None else None
            pending.outputs.append(c)
            by_index[c.index] = c
            continue
        old.text += c.text
        old.token_ids.extend(c.token_ids)
        if c.logprobs is not None:
            old.logprobs = (old.logprobs or []) + list(c.logprobs)
        for name in _LATEST_WINS:
            setattr(old, name, getattr(c, name))
    pending.finished = new.finished
    pending.num_cached_tokens = new.num_cached_tokens
    if new.prompt_logprobs:  # DELTA: positions not sent before
        pending.prompt_logprobs = [*(pending.prompt_logprobs or ()), *new.prompt_logprobs]
    elif pending.prompt_logprobs is None:
        pending.prompt_logprobs = new.prompt_logprobs
    pending.metrics = new.metrics or pending.metrics
    pending.abort_reason = new.abort_reason or pending.abort_reason
    pending.error = new.error or pending.error
    pending.seed = new.seed if new.seed is not None else pending.seed


class RequestStream:
    """Pending output + wake-up event for one in-flight request (event-loop side only)."""

    def __init__(self, request_id: str, max_backlog_bytes: int, max_backlog_age_s: float) -> None:
        self.request_id = request_id
        self.n = 1  # its sequences in the engine (SamplingParams.n), for the admission cap
        self.max_backlog_bytes = max_backlog_bytes
        self.max_backlog_age_s = max_backlog_age_s
        self.pending: RequestOutput | None = None
        self.pending_bytes = 0
        self.pending_since: float | None = None  # monotonic time the oldest unsent delta arrived
        self.error: BaseException | None = None  # raised to the consumer once pending is drained
        self.finished = False  # the engine produced the final output (the id can be released)
        self.aborting = False  # an abort was queued; the id stays reserved until `finished`
        self.abort_reason = ""
        self.num_coalesced = 0  # deltas merged into a previous pending one (observability, tests)
        self._event = asyncio.Event()

    def put(self, out: RequestOutput) -> bool:
        """Add one engine output. Returns False when the backlog cap is exceeded (caller aborts)."""
        if out.finished:
            self.finished = True
            if self.abort_reason and not out.abort_reason:
                out.abort_reason = self.abort_reason
        nbytes = output_nbytes(out)
        now = time.monotonic()
        if self.pending is None:
            self.pending = out
            self.pending_bytes = nbytes
            self.pending_since = now
        else:
            merge_delta(self.pending, out)
            self.pending_bytes += nbytes
            self.num_coalesced += 1
        self._event.set()
        return not self.over_backlog(now)

    def over_backlog(self, now: float | None = None) -> bool:
        if self.pending is None or self.pending.finished:
            return False  # the engine holds nothing for it any more; let the reader drain
        now = time.monotonic() if now is None else now
        return (self.pending_bytes > self.max_backlog_bytes
                or (self.pending_since is not None and now - self.pending_since > self.max_backlog_age_s))

    def fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
        self._event.set()

    async def get(self) -> RequestOutput:
        """Next (coalesced) output; raises the stream's error once nothing is pending."""
        while True:
            if self.error is not None:
                self.pending = None
                raise self.error
            if self.pending is not None:
                out, self.pending, self.pending_bytes, self.pending_since = self.pending, None, 0, None
                return out
            self._event.clear()
            await self._event.wait()
