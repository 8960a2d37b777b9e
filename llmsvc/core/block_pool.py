"""BlockPool: the fixed set of KV blocks, their reference counts, the LRU free queue and
the prefix-cache map (torch-free).

Promises:
- a block is in the free queue iff its ref_cnt == 0; allocation pops from the queue's front
  (least recently freed first), so cached blocks freed long ago are evicted first;
- a block with a hash stays findable by `get_cached_block` until it is evicted (re-allocated),
  also while its ref_cnt is 0;
- freeing a block whose ref_cnt is already 0 raises (double free), never passes silently.
"""
from __future__ import annotations

from collections import OrderedDict

from llmsvc.core.kv_events import KVEventJournal


class DoubleFreeError(RuntimeError):
    pass


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True, events: KVEventJournal | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref_cnt: list[int] = [0] * num_blocks  # block_id -> number of requests holding it
        self.block_hash: list[bytes | None] = [None] * num_blocks  # block_id -> its hash when cached
        # free queue in eviction order (front = evicted first); values unused
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[bytes, int] = {}  # block hash -> block_id
        self.num_evictions = 0
        self.events = events  # records evictions and resets for cache-aware routers (None: nobody asks)
        # called with (block_id, hash) as a cached block is evicted, before it is reused (the swap
        # space keeps a copy: the host tier of the prefix cache, llmsvc/core/swap.py); None: off
        self.on_evict = None
        self.on_reset = None  # called when the prefix cache is reset (the host tier forgets too)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def usage(self) -> float:
        """Fraction of blocks held by requests (cached-but-free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_new_blocks(self, n: int) -> list[int]:
        """Take n blocks from the front of the free queue (evicting their cache entries), ref_cnt=1."""
        if n > len(self.free_queue):
            raise ValueError(f"cannot allocate {n} blocks, {len(self.free_queue)} free")
        out = []
        for _ in range(n):
            block_id, _ = self.free_queue.popitem(last=False)
            self._evict(block_id)
            self.ref_cnt[block_id] = 1
            out.append(block_id)
        return out

    def _evict(self, block_id: int) -> None:
        h = self.block_hash[block_id]
        if h is not None:
            self.block_hash[block_id] = None
            if self.cached.get(h) == block_id:
                del self.cached[h]
            self.num_evictions += 1
            if self.events is not None:
                self.events.removed(h)
            if self.on_evict is not None:
                self.on_evict(block_id, h)

    def touch(self, block_ids: list[int]) -> None:
        """A request starts sharing these (cached) blocks: ref_cnt += 1, out of the free queue."""
        for b in block_ids:
            if self.ref_cnt[b] == 0:
                del self.free_queue[b]
            self.ref_cnt[b] += 1

    def free_blocks(self, ordered_block_ids) -> None:
        """Drop one reference of each block; blocks reaching 0 join the free queue's back in the
        given order (pass a request's blocks tail first so its prefix is evicted last)."""
        for b in ordered_block_ids:
            if self.ref_cnt[b] <= 0:
                raise DoubleFreeError(f"block {b} freed with ref_cnt {self.ref_cnt[b]}")
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] == 0:
                self.free_queue[b] = None

    def get_cached_block(self, block_hash: bytes) -> int | None:
        return self.cached.get(block_hash)

    def cache_block(self, block_id: int, block_hash: bytes) -> bool:
        """Register a full, held block under its hash (first writer wins on duplicates).
        Returns whether it was registered now."""
        if not self.enable_caching or self.block_hash[block_id] is not None:
            return False
        if block_hash in self.cached:
            return False  # an identical block is already cached; this one stays anonymous
        self.block_hash[block_id] = block_hash
        self.cached[block_hash] = block_id
        return True

    def uncache_block(self, block_id: int) -> None:
        """Forget a held block's hash: the step that was to compute its K/V will not."""
        h = self.block_hash[block_id]
        if h is None:
            return
        self.block_hash[block_id] = None
        if self.cached.get(h) == block_id:
            del self.cached[h]
            if self.events is not None:
                self.events.removed(h)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only allowed when no block is held."""
        if self.num_free_blocks != self.num_blocks:
            return False
        self.cached.clear()
        self.block_hash = [None] * self.num_blocks
        if self.events is not None:
            self.events.cleared()
        if self.on_reset is not None:
            self.on_reset()
        return True

    def check_invariants(self) -> None:
        for b in range(self.num_blocks):
            assert self.ref_cnt[b] >= 0, (b, self.ref_cnt[b])
            assert (self.ref_cnt[b] == 0) == (b in self.free_queue), (b, self.ref_cnt[b])
        for h, b in self.cached.items():
            assert self.block_hash[b] == h, (b, h)
