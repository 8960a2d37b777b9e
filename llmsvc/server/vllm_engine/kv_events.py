"""SubscribeKvEvents: the prefix cache's stored / removed / cleared blocks, for a gateway's
cache-aware routing (smg.grpc.common.KvEventBatch).

KVEventRelay is the one reader of the engine's event journal (llmsvc.core.kv_events): the engine
thread hands it each step's new events before that step's outputs (AsyncEngine.follow_kv_events),
so a gateway has a request's cached blocks before its client sees the request finish and sends
the next turn. Each page becomes one KvEventBatch numbered 1, 2, 3, ... for every subscriber.
It also keeps the blocks the cache holds now (hash -> tokens, parent),
so a subscriber that starts without a cursor (start_sequence_number 0) first gets them all: one
batch numbered as the last one sent, holding a `cleared` and then every live block, parents
before children. A cursor the relay still has batches after is served by replaying them; one it
has not (too old, or from before a restart) is refused with OUT_OF_RANGE, and a subscriber
that falls QUEUE_BATCHES behind is ended with DATA_LOSS: either way the gateway starts over
from 0. When the engine dies or the server stops, every stream ends (UNAVAILABLE), which is how
a gateway learns within seconds to route elsewhere.

Load records: every batch carries the engine's load (EngineLoad: the numbers GetLoads gives), and
while anyone subscribes the relay sends a load-only batch when the load changed without a KV
event and at least once a second, so a gateway routes on fresh numbers without polling GetLoads
and tells a wedged engine from an idle one.

Hashes: a block's hash is our chained prefix-cache hash (sha256 of the previous block's hash and
this block's token ids), given as its first 8 bytes read as a signed big-endian int64; equal
prefixes on any replica give equal hashes. Each stored block carries its token ids and
block_size (the gateway hashes the tokens for its own index) and the hash of the block before it.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import Awaitable, Callable

from llmsvc.core.kv_events import CLEARED, REMOVED, STORED
from llmsvc.server.vllm_engine.proto import common_pb2 as cpb

logger = logging.getLogger(__name__)
HISTORY_BATCHES = 1024  # batches kept for subscribers that reconnect with a cursor
QUEUE_BATCHES = 4096  # batches a subscriber may fall behind before its stream ends (DATA_LOSS)
BEAT_S = 0.1  # how often the load is looked at for a load-only batch (vLLM's servicer: ~100 ms)
IDLE_BEAT_S = 1.0  # a load-only batch at least this often, changed or not: the engine is alive


def _routing_core(load: cpb.EngineLoad) -> tuple:
    """What a gateway routes on: a change in it is worth a load-only batch."""
    return load.running_requests, load.waiting_requests, load.waiting_uncached_tokens, load.token_usage


def block_hash64(h: bytes) -> int:
    return int.from_bytes(h[:8], "big", signed=True)


class CursorError(Exception):
    """A start_sequence_number this relay cannot continue from."""


class StreamEnded(Exception):
    """The relay stopped (engine dead, server stopping) or this subscriber fell behind."""

    def __init__(self, why: str, data_loss: bool = False) -> None:
        super().__init__(why)
        self.data_loss = data_loss


class Subscription:
    def __init__(self) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()
        self.ended: StreamEnded | None = None

    def put(self, batch) -> None:
        if self.ended is None and self.queue.qsize() >= QUEUE_BATCHES:
            self.end(StreamEnded("this subscriber fell too far behind the KV events", data_loss=True))
        elif self.ended is None:
            self.queue.put_nowait(batch)

    def end(self, why: StreamEnded) -> None:
        if self.ended is None:
            self.ended = why
            self.queue.put_nowait(None)

    async def next(self):
        """The next batch; raises StreamEnded once the stream is over."""
        batch = await self.queue.get()
        if batch is None:
            raise self.ended
        return batch


class KVEventRelay:
    """`follow(listener)`: awaits the engine's consent to call listener(KVEventPage) on this loop
    with its new events from now on (AsyncEngine.follow_kv_events); `dead()`: an awaitable that
    resolves when the engine dies (AsyncEngine.wait_dead)."""

    def __init__(self, follow: Callable[[Callable], Awaitable[None]], dead: Callable[[], Awaitable],
                 load: Callable[[bool], cpb.EngineLoad] | None = None) -> None:
        """`load(full)`: the engine's load record now (LoadTracker.engine_load), put on every
        batch; None: batches carry none."""
        self._follow = follow
        self._dead = dead
        self._load = load
        self._sample = 0  # load records numbered 1, 2, ... (monotonic on every stream)
        self._sent_load: tuple = ()  # the routing core of the last record sent, and when
        self._sent_at = 0.0
        self._cursor = 0  # the journal's last event read
        self._seq = 0  # the last batch number given
        self._event_id = 0
        self._history: deque = deque(maxlen=HISTORY_BATCHES)
        self._live: dict[int, tuple[tuple[int, ...], int | None]] = {}  # hash -> (tokens, parent hash)
        self._block_size = 0
        self._subs: set[Subscription] = set()
        self._task: asyncio.Task | None = None
        self._beat_task: asyncio.Task | None = None
        self.ended: StreamEnded | None = None

    async def start(self) -> None:
        """Turn the engine's recording on and follow it; every stream ends when the engine dies."""
        await self._follow(self.feed)
        self._task = asyncio.create_task(self._watch(), name="kv-event-relay")
        if self._load is not None:
            self._beat_task = asyncio.create_task(self._beat(), name="kv-event-load")

    async def stop(self, why: str = "the server is stopping") -> None:
        self._end_all(StreamEnded(why))
        tasks = [t for t in (self._task, self._beat_task) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _end_all(self, why: StreamEnded) -> None:
        self.ended = self.ended or why
        for s in list(self._subs):
            s.end(why)
        self._subs.clear()

    async def _watch(self) -> None:
        e = await self._dead()
        logger.info("KV event relay stopped: the engine died (%s)", type(e).__name__)
        self._end_all(StreamEnded(f"the engine stopped ({type(e).__name__}); route elsewhere"))

    def feed(self, page) -> None:
        """One page of the engine's journal (llmsvc.core.kv_events.KVEventPage), in order."""
        if self.ended is not None or not page.events:
            return
        self._block_size = page.block_size
        if page.first_seq > self._cursor + 1 and self._cursor:
            # a gap: the journal dropped events this relay never read; what the cache holds is
            # unknown from here, so say so (cleared) and start over with what comes
            logger.warning("KV events %d-%d were lost; subscribers are told the cache was cleared",
                           self._cursor + 1, page.first_seq - 1)
            page.events.insert(0, (page.first_seq - 1, CLEARED))
        self._cursor = page.events[-1][0]
        self._publish(self._convert(page.events))

    def _convert(self, events) -> list:
        """Journal events -> KvCacheEvents (a run of stored blocks each following the one before
        goes as one event); updates the live-block map."""
        out, bs = [], self._block_size
        for _, kind, *fields in events:
            self._event_id += 1
            if kind == STORED:
                h, parent, tokens = block_hash64(fields[0]), fields[1], fields[2]
                parent = block_hash64(parent) if parent is not None else None
                self._live[h] = (tokens, parent)
                last = out[-1] if out else None
                if (last is not None and last.HasField("stored") and
                        last.stored.blocks[-1].block_hash == parent):
                    last.stored.blocks.add(block_hash=h, token_ids=tokens, block_size=bs)
                    continue
                ev = cpb.KvCacheEvent(event_id=self._event_id, stored=cpb.KvBlocksStored(
                    blocks=[cpb.KvBlock(block_hash=h, token_ids=tokens, block_size=bs)]))
                if parent is not None:
                    ev.stored.parent_block_hash = parent
                out.append(ev)
            elif kind == REMOVED:
                h = block_hash64(fields[0])
                self._live.pop(h, None)
                out.append(cpb.KvCacheEvent(event_id=self._event_id, removed=cpb.KvBlocksRemoved(block_hashes=[h])))
            elif kind == CLEARED:
                self._live.clear()
                out.append(cpb.KvCacheEvent(event_id=self._event_id, cleared=cpb.KvCacheCleared()))
        return out

    # ---- load records -----------------------------------------------------------------------
    def _record(self, full: bool) -> cpb.EngineLoad | None:
        """The next load record (None without a load source), noted as the last one sent."""
        return None if self._load is None else self._numbered(self._load(full))

    def _numbered(self, load: cpb.EngineLoad) -> cpb.EngineLoad:
        self._sample += 1
        load.sample = self._sample
        self._sent_load = _routing_core(load)
        self._sent_at = time.monotonic()
        return load

    async def _beat(self) -> None:
        """A load-only batch (numbered as the last batch sent, kept out of the history) whenever
        the load changed without a KV event (an admission served from cache, a completion) and
        at least every IDLE_BEAT_S: a subscriber routes on current numbers, and silence means a
        wedged engine, not an idle one."""
        while True:
            await asyncio.sleep(BEAT_S)
            if not self._subs:
                continue
            load = self._load(True)
            if _routing_core(load) != self._sent_load or time.monotonic() - self._sent_at >= IDLE_BEAT_S:
                record = self._numbered(load)
                record.load_only = True
                batch = cpb.KvEventBatch(sequence_number=self._seq, timestamp=time.time(), load=record)
                for sub in self._subs:
                    sub.put(batch)

    def _publish(self, events: list) -> None:
        self._seq += 1
        batch = cpb.KvEventBatch(sequence_number=self._seq, timestamp=time.time(), events=events,
                                 load=self._record(False))
        self._history.append(batch)
        for s in self._subs:
            s.put(batch)

    def snapshot(self) -> cpb.KvEventBatch:
        """Every live block, after a `cleared`, numbered as the last batch sent (a stream's first
        record: the load with its full telemetry)."""
        batch = cpb.KvEventBatch(sequence_number=self._seq, timestamp=time.time(), load=self._record(True))
        batch.events.add(cleared=cpb.KvCacheCleared())
        for h, (tokens, parent) in self._live.items():
            ev = batch.events.add()
            ev.stored.blocks.add(block_hash=h, token_ids=tokens, block_size=self._block_size)
            if parent is not None:
                ev.stored.parent_block_hash = parent
        return batch

    async def subscribe(self, start_seq: int) -> Subscription:
        """A subscription whose queue starts with the snapshot (start_seq 0) or the batches after
        start_seq, as of the engine's latest events. Raises CursorError for a cursor it cannot
        continue, StreamEnded once stopped."""
        if self.ended is not None:
            raise self.ended
        sub = Subscription()
        if start_seq == 0:
            sub.put(self.snapshot())
        else:
            oldest = self._history[0].sequence_number if self._history else self._seq + 1
            if start_seq > self._seq or start_seq < oldest - 1:
                raise CursorError(f"start_sequence_number {start_seq} is outside the batches kept "
                                  f"({oldest - 1}..{self._seq}); subscribe with 0 for a snapshot")
            for batch in self._history:
                if batch.sequence_number > start_seq:
                    sub.put(batch)
        self._subs.add(sub)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        self._subs.discard(sub)
