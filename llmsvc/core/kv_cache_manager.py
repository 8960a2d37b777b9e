"""KVCacheManager: which blocks each request holds, prefix-cache lookups, slot allocation.

Block hashes are chained: hash(block i) = sha256(hash(block i-1) || token ids of block i), so a
hit on block i implies the whole prefix up to it matches. Only full blocks are hashed. Block 0's
parent is the request's salt hash (of its `cache_salt` and LoRA adapter; NONE_HASH with neither),
so requests share cached blocks only within one salt and one adapter.

Blocks are registered in the prefix cache when they are allocated for a step that fills them
(as vLLM does): another request scheduled in the same step may reuse them, which is sound because
a worker stores every token's K/V of a layer before that layer's attention reads the cache.

Sliding windows: when every layer of the model attends only to its last `sliding_window`
positions, a running request's leading blocks that lie wholly before the window of the first
token it computes next are released (vLLM's sliding-window manager does the same). The
request keeps their ids in its list (workers keep them in their block tables: no message
changes) but no longer holds them; every attention kernel starts reading at the window, so the
stale ids are never dereferenced. A request's KV footprint stays about
(sliding_window + tokens per step) / block_size blocks however long it runs.
"""
from __future__ import annotations

import hashlib
from array import array

from llmsvc.core.block_pool import BlockPool
from llmsvc.core.kv_events import KVEventJournal
from llmsvc.core.request import Request

NONE_HASH = b"\x00" * 32


def salt_hash(cache_salt: str | None, lora_key: str | None = None) -> bytes | None:
    """The parent hash of a request's first block: None for an unsalted request of the base
    model; else a hash of its salt and its adapter (whose K/V differ from the base model's)."""
    if not cache_salt and not lora_key:
        return None
    h = hashlib.sha256(b"llmsvc cache_salt+lora")
    for field in (cache_salt or "", lora_key or ""):  # length-prefixed: no salt can spell an adapter
        data = field.encode()
        h.update(len(data).to_bytes(8, "little") + data)
    return h.digest()


def hash_block_tokens(parent_hash: bytes | None, token_ids) -> bytes:
    h = hashlib.sha256(parent_hash or NONE_HASH)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 sliding_window: int | None = None) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.sliding_window = sliding_window  # every layer's window (None: some layer sees everything)
        self.num_released: dict[str, int] = {}  # req_id -> leading blocks given back (window)
        # stored / removed / cleared events of the prefix cache, recorded once a reader asks
        self.events = KVEventJournal(block_size)
        self.pool = BlockPool(num_blocks, enable_caching, self.events)
        self.req_to_blocks: dict[str, list[int]] = {}
        self.num_cached_block: dict[str, int] = {}  # req_id -> leading blocks already registered
        # prefix-cache counters, over the tokens of every request admitted
        self.prefix_queries = 0
        self.prefix_hits = 0

    # ---- observability ---------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def capacity_tokens(self) -> int:
        return self.pool.num_blocks * self.block_size

    def max_request_tokens(self, step_tokens: int) -> int | None:
        """The most tokens one request may hold, alone in the pool, when each step computes at
        most `step_tokens` of it: the pool's capacity; None (no bound) with sliding windows
        when the pool holds a window and a step, all a request keeps however long it runs."""
        if self.sliding_window and self.pool.num_blocks >= cdiv(self.sliding_window + step_tokens,
                                                                self.block_size) + 1:
            return None
        return self.capacity_tokens

    def usage(self) -> float:
        return self.pool.usage()

    def hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count an admission's prompt tokens looked up in the prefix cache, and those found;
        with caching off nothing is looked up, so nothing is counted (as vLLM)."""
        if not self.enable_caching:
            return
        self.prefix_queries += num_tokens
        self.prefix_hits += num_hit_tokens

    def get_block_ids(self, req_id: str) -> list[int]:
        return self.req_to_blocks.get(req_id, [])

    # ---- hashing ---------------------------------------------------------------------------
    def _update_block_hashes(self, request: Request) -> None:
        """Extend request.block_hashes to every full block of its known tokens (a block holding an
        async-scheduling placeholder is hashed once that token is known)."""
        bs = self.block_size
        tokens = request.all_token_ids
        hashes = request.block_hashes
        for i in range(len(hashes), request.num_known_tokens // bs):
            parent = hashes[-1] if hashes else salt_hash(request.cache_salt, request.lora_key)
            hashes.append(hash_block_tokens(parent, tokens[i * bs:(i + 1) * bs]))

    # ---- lookups and allocation ------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Longest cached prefix of the request: (block ids, number of tokens they hold).

        At least one token is always left to compute (logits are needed), so hits are capped at
        num_tokens - 1 tokens. Requests asking for prompt logprobs never hit (every position must
        be computed). Does not take references; pass the blocks to `allocate_slots`."""
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        self._update_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for h in request.block_hashes[:max_blocks]:
            b = self.pool.get_cached_block(h)
            if b is None:
                break
            hits.append(b)
        return hits, len(hits) * self.block_size

    def can_hold(self, request: Request, new_computed_blocks: list[int] | tuple = ()) -> bool:
        """Whether the free blocks (less the hits they include) hold all of a waiting request's
        tokens from its cache hits on. Layers with a sliding window need only the window's, so
        for them any room for the next chunk will do (True)."""
        if self.sliding_window:
            return True
        need = cdiv(request.num_tokens, self.block_size) - len(new_computed_blocks)
        return need <= self._free_besides(new_computed_blocks)

    def num_free_blocks_besides(self, hits) -> int:
        return self._free_besides(hits)

    def _free_besides(self, hits) -> int:
        """Free blocks other than these cache hits: hits sitting in the free queue stop being
        free once touched."""
        return self.pool.num_free_blocks - sum(1 for b in hits if self.pool.ref_cnt[b] == 0)

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[int] | tuple = (),
                       num_lookahead_tokens: int = 0) -> list[int] | None:
        """Make room for `num_new_tokens` more tokens after request.num_computed_tokens (plus the
        tokens of `new_computed_blocks`, prefix-cache hits for a request not yet holding blocks),
        and for `num_lookahead_tokens` draft tokens after them (speculative decoding: slots only;
        no block is registered in the prefix cache on their account).

        Returns the newly allocated block ids (possibly []), or None when the pool cannot supply
        them (then nothing changed but the release of blocks outside the sliding window)."""
        req_blocks = self.req_to_blocks.setdefault(request.request_id, [])
        assert not new_computed_blocks or not req_blocks, "cache hits only for a request holding no blocks"
        if self.sliding_window and req_blocks:
            self._release_outside_window(request, req_blocks)
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        num_total = num_computed + num_new_tokens
        assert num_total <= request.num_tokens, (num_total, request)
        num_slots = num_total + num_lookahead_tokens
        num_new_blocks = max(0, cdiv(num_slots, self.block_size) - len(req_blocks) - len(new_computed_blocks))
        if num_new_blocks > self._free_besides(new_computed_blocks):
            if not req_blocks:
                del self.req_to_blocks[request.request_id]
            return None
        if new_computed_blocks:
            self.pool.touch(list(new_computed_blocks))
            req_blocks.extend(new_computed_blocks)
            self.num_cached_block[request.request_id] = len(new_computed_blocks)
        new_blocks = self.pool.get_new_blocks(num_new_blocks)
        req_blocks.extend(new_blocks)
        if self.enable_caching:
            self._cache_full_blocks(request, num_total)
        return new_blocks

    def allocate_swapped_in(self, request: Request, num_swapped_blocks: int,
                            num_new_tokens: int) -> tuple[list[int], int] | None:
        """Blocks for a request coming back from the swap space (holding none): the first
        num_swapped_blocks hold its swapped K/V, the rest are room for the num_new_tokens it
        computes next. Its leading full blocks still in the prefix cache are shared as hits (no
        copy needed); the others of the swapped ones receive their copy before the step's forward
        pass. Returns (blocks, number of leading hits), or None when the pool cannot supply them
        (nothing changed)."""
        assert request.request_id not in self.req_to_blocks, request
        hits: list[int] = []
        if self.enable_caching:
            for h in request.block_hashes[:min(num_swapped_blocks, request.num_computed_tokens // self.block_size)]:
                b = self.pool.get_cached_block(h)
                if b is None:
                    break
                hits.append(b)
        num_total = request.num_computed_tokens + num_new_tokens
        n = max(num_swapped_blocks, cdiv(num_total, self.block_size)) - len(hits)
        if n > self._free_besides(hits):
            return None
        self.pool.touch(hits)
        blocks = hits + self.pool.get_new_blocks(n)
        self.req_to_blocks[request.request_id] = blocks
        self.num_cached_block[request.request_id] = len(hits)
        if self.enable_caching:
            self._cache_full_blocks(request, num_total)
        return blocks, len(hits)

    def load_cached_block(self, block_hash: bytes, parent_hash: bytes | None = None, token_ids=()) -> int:
        """A free block registered under block_hash, its K/V to be copied in from the host tier
        before the step's forward pass; it waits in the free queue (most recently used) for the
        admission that hits it. Its parent's hash and token ids go into the `stored` event: the
        device's prefix cache holds the block again."""
        (b,) = self.pool.get_new_blocks(1)
        if self.pool.cache_block(b, block_hash) and self.events.enabled:
            self.events.stored(block_hash, parent_hash, token_ids)
        self.pool.free_blocks([b])
        return b

    def _release_outside_window(self, request: Request, req_blocks: list[int]) -> None:
        """Give back the leading blocks no token from num_computed_tokens on can see: the first
        one to compute, at position p, sees positions > p - sliding_window. Those blocks are full
        and already registered in the prefix cache, where they stay until evicted. Another
        request may get one for this very step: it writes it only in its own store_kv, and no
        step of this request, this one or later, reads it again."""
        first_visible = request.num_computed_tokens - self.sliding_window + 1
        n = min(max(0, first_visible) // self.block_size, len(req_blocks))
        done = self.num_released.get(request.request_id, 0)
        if n > done:
            self.pool.free_blocks(req_blocks[done:n])
            self.num_released[request.request_id] = n

    def num_held_blocks(self, req_id: str) -> int:
        """Blocks the request holds now (its list minus those released outside the window)."""
        return len(self.req_to_blocks.get(req_id, ())) - self.num_released.get(req_id, 0)

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the request's blocks that will be full once `num_tokens` tokens are computed
        and whose token ids are all known (later allocations register the rest)."""
        num_full = min(num_tokens, request.num_known_tokens) // self.block_size
        start = self.num_cached_block.get(request.request_id, 0)
        if num_full <= start:
            return
        self._update_block_hashes(request)
        blocks = self.req_to_blocks[request.request_id]
        hashes, bs = request.block_hashes, self.block_size
        for i in range(start, num_full):
            if self.pool.cache_block(blocks[i], hashes[i]) and self.events.enabled:
                self.events.stored(hashes[i], hashes[i - 1] if i else None, request.all_token_ids[i * bs:(i + 1) * bs])
        self.num_cached_block[request.request_id] = num_full

    def forget_uncomputed(self, request: Request) -> None:
        """Before a preemption: unregister the request's blocks that were registered for work not
        computed (a step it is taken back out of): blocks from the one holding position
        num_computed_tokens on. Left cached, a later hit (or the host tier's copy of them) would
        read K/V that was never written. Blocks another request holds too keep their hash."""
        blocks = self.req_to_blocks.get(request.request_id)
        if not blocks:
            return
        start = request.num_computed_tokens // self.block_size
        end = self.num_cached_block.get(request.request_id, 0)
        for b in blocks[start:end]:
            if self.pool.ref_cnt[b] == 1:
                self.pool.uncache_block(b)
        if end > start:
            self.num_cached_block[request.request_id] = start

    def free(self, request: Request) -> None:
        """Release every block of the request (tail first, so its prefix is evicted last)."""
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self.num_cached_block.pop(request.request_id, None)
        released = self.num_released.pop(request.request_id, 0)
        if blocks:
            self.pool.free_blocks(reversed(blocks[released:]))

    def check_invariants(self) -> None:
        """Every block's ref_cnt equals the number of requests holding it (tests)."""
        self.pool.check_invariants()
        held = [0] * self.pool.num_blocks
        for req_id, blocks in self.req_to_blocks.items():
            blocks = blocks[self.num_released.get(req_id, 0):]
            assert len(set(blocks)) == len(blocks), blocks
            for b in blocks:
                held[b] += 1
        assert held == self.pool.ref_cnt, (held, self.pool.ref_cnt)
