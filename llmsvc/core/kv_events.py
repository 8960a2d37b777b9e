"""KVEventJournal: what the prefix cache stored and evicted, numbered, for gateways that route
by cache contents (torch-free).

Off until someone asks (`EngineCore.take_kv_events`, the first call turns it on): an engine
nobody routes by records nothing. Once on, every change of the prefix cache is one event:

- ("stored", block_hash, parent_hash, token_ids): a full block registered under its chained
  hash; parent_hash is the previous block's, None for a request's first block (whose chain
  starts at the request's salt, which no block carries);
- ("removed", block_hash): a cached block evicted (re-allocated), its hash forgotten;
- ("cleared",): every hash forgotten at once (reset_prefix_cache).

Events get consecutive sequence numbers from 1. The journal keeps the last `capacity` of them;
a reader passes the last number it has and gets the ones after it, plus the oldest number
still held, so it can tell when it fell behind (then it must start over from a snapshot).

Across processes the engine core pushes: `drain()` gives what was recorded since the last drain
and goes out with each output batch; the front end keeps a mirror (`extend`, numbers kept) that
its readers take from, so events reach a gateway with the step's outputs, not a poll later.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

STORED, REMOVED, CLEARED = "stored", "removed", "cleared"
DEFAULT_CAPACITY = 1 << 16


@dataclass
class KVEventPage:
    """Events after a reader's cursor: `events` are (seq, kind, *fields) tuples, consecutive;
    `first_seq` is the oldest number the journal still held (1 + the last one ever if empty);
    `last_seq` is the newest number given so far (0: none yet)."""

    events: list[tuple] = field(default_factory=list)
    first_seq: int = 1
    last_seq: int = 0
    block_size: int = 0


class KVEventJournal:
    def __init__(self, block_size: int, capacity: int = DEFAULT_CAPACITY) -> None:
        self.block_size = block_size
        self.enabled = False
        self._events: deque[tuple] = deque(maxlen=capacity)
        self._last_seq = 0
        self._drained = 0  # the last number drain() gave

    def _add(self, *event) -> None:
        self._last_seq += 1
        self._events.append((self._last_seq, *event))

    def stored(self, block_hash: bytes, parent_hash: bytes | None, token_ids) -> None:
        if self.enabled:
            self._add(STORED, block_hash, parent_hash, tuple(token_ids))

    def removed(self, block_hash: bytes) -> None:
        if self.enabled:
            self._add(REMOVED, block_hash)

    def cleared(self) -> None:
        if self.enabled:
            self._add(CLEARED)

    def take(self, after_seq: int, limit: int = 4096) -> KVEventPage:
        """At most `limit` events numbered after `after_seq` (turns recording on)."""
        self.enabled = True
        first = self._events[0][0] if self._events else self._last_seq + 1
        start = max(0, after_seq + 1 - first)
        events = [self._events[i] for i in range(start, min(len(self._events), start + limit))]
        return KVEventPage(events, first, self._last_seq, self.block_size)

    def drain(self) -> list[tuple]:
        """Every event recorded since the last drain (none while recording is off)."""
        if self._last_seq == self._drained:
            return []
        page = self.take(self._drained, limit=len(self._events))
        self._drained = self._last_seq
        return page.events

    def extend(self, events: list[tuple]) -> None:
        """Mirror another journal: append its events, numbered as there, skipping those already
        held. After a gap the older events are dropped, so a reader behind it sees that it fell
        behind (`first_seq`)."""
        self.enabled = True
        for event in events:
            if event[0] <= self._last_seq:
                continue
            if event[0] != self._last_seq + 1:
                self._events.clear()
            self._events.append(event)
            self._last_seq = event[0]
