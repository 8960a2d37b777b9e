"""SwapSpace: the host-memory block pool beside the KV cache, and the copies of one step (torch-free).

Host blocks are numbered 0..num_blocks-1 like device blocks; a worker holds the same number of
host blocks of the same shape (llmsvc/worker/kv_swap.py). A host block is in one of three states:
- held by a swapped-out request (ref_cnt 1, or more while this step's swap-in reads it);
- in the host tier of the prefix cache: ref_cnt 0, registered under its chained block hash, in the
  LRU free queue (a prefix block evicted from the KV cache, or a swapped request's full block
  after it came back); a later request whose hashes match gets it copied back to the device;
- free and anonymous.
BlockPool supplies all three (reference counts, LRU free queue, hash map).

The copies of a step are SchedulerOutput's blocks_to_swap_out [(device, host)], blocks_to_swap_in
[(host, device)] and blocks_to_copy [(device, device)]; the worker runs them in that order before
the step's forward pass. Invariants that make that order sound:
- a device block copied out in a step may be reallocated in the same step: the copy reads it
  before the forward pass (or a swap-in) writes it;
- a host block read by a swap-in keeps a reference until the step is built (`pin`), so no
  swap-out of the same step can overwrite it (swap-outs run first);
- copies of a step that ends up executing nothing stay pending and go with the next executed step
  (the worker runs them all before that step's forward, outs first), as finished_req_ids do.
"""
from __future__ import annotations

from llmsvc.core.block_pool import BlockPool


class SwapSpace:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[int]] = {}  # swapped-out request -> its host blocks
        self.blocks_to_swap_out: list[tuple[int, int]] = []
        self.blocks_to_swap_in: list[tuple[int, int]] = []
        self.blocks_to_copy: list[tuple[int, int]] = []
        self._pinned: list[int] = []  # host blocks read by the pending swap-ins
        # counters (Prometheus, GetServerInfo)
        self.num_swap_outs = 0  # requests swapped out
        self.num_swap_ins = 0  # requests swapped back in
        self.num_blocks_swapped_out = 0  # blocks copied device -> host (swap-outs and host-tier stores)
        self.num_blocks_swapped_in = 0  # blocks copied host -> device (swap-ins and host-tier hits)
        self.num_host_hits = 0  # prefix blocks served from the host tier instead of recomputed
        self.num_host_stores = 0  # evicted prefix blocks kept in the host tier

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Host blocks not held by a swapped request (host-tier blocks count: they are evictable)."""
        return self.pool.num_free_blocks

    @property
    def num_held_blocks(self) -> int:
        return sum(len(b) for b in self.req_to_blocks.values())

    def has_pending_copies(self) -> bool:
        return bool(self.blocks_to_swap_out or self.blocks_to_swap_in or self.blocks_to_copy)

    # ---- swapped requests -------------------------------------------------------------------
    def swap_out(self, req_id: str, device_blocks: list[int], hashes: list[bytes]) -> None:
        """Copy these device blocks to fresh host blocks held for req_id (caller checked room).
        The first len(hashes) are full blocks: registered in the host tier too, so an eviction of
        the same prefix from the device needs no second copy and other requests may hit them."""
        host = self.pool.get_new_blocks(len(device_blocks))
        for b, h in zip(host, hashes):
            self.pool.cache_block(b, h)
        self.req_to_blocks[req_id] = host
        self.blocks_to_swap_out.extend(zip(device_blocks, host))
        self.num_swap_outs += 1
        self.num_blocks_swapped_out += len(host)

    def swap_in(self, req_id: str, device_blocks: list[int], num_cached: int = 0) -> None:
        """Copy req_id's host blocks to these device blocks (as many), but for the first
        num_cached (prefix-cache hits on the device hold them already), and give the host blocks
        up once the step is built (full ones stay in the host tier)."""
        host = self.req_to_blocks.pop(req_id)
        assert len(device_blocks) == len(host), (len(device_blocks), len(host))
        self.blocks_to_swap_in.extend(zip(host[num_cached:], device_blocks[num_cached:]))
        self._pinned.extend(host)  # their reference moves to the pin
        self.num_swap_ins += 1
        self.num_blocks_swapped_in += len(host) - num_cached

    def free(self, req_id: str) -> None:
        """A swapped request finished (abort, deadline): its host blocks go back to the pool."""
        host = self.req_to_blocks.pop(req_id, None)
        if host:
            self.pool.free_blocks(reversed(host))

    # ---- host tier of the prefix cache ------------------------------------------------------
    def store_evicted(self, device_block: int, block_hash: bytes) -> None:
        """The KV cache evicts a cached block: keep a copy under its hash unless the tier has one
        already or every host block is held (then it is simply gone, as without a swap space)."""
        if self.pool.get_cached_block(block_hash) is not None or not self.pool.num_free_blocks:
            return
        (host,) = self.pool.get_new_blocks(1)
        self.pool.cache_block(host, block_hash)
        self.pool.free_blocks([host])  # ref 0: evictable, most recently used
        self.blocks_to_swap_out.append((device_block, host))
        self.num_host_stores += 1
        self.num_blocks_swapped_out += 1

    def forget_tier(self) -> None:
        """The prefix cache was reset: unregister every host-tier block no request holds."""
        for b in list(self.pool.free_queue):
            h = self.pool.block_hash[b]
            if h is not None:
                self.pool.block_hash[b] = None
                if self.pool.cached.get(h) == b:
                    del self.pool.cached[h]

    def lookup(self, block_hash: bytes) -> int | None:
        return self.pool.get_cached_block(block_hash)

    def pin(self, host_blocks: list[int]) -> None:
        """Hold these host-tier blocks until the step is built: this step's swap-ins read them."""
        self.pool.touch(host_blocks)
        self._pinned.extend(host_blocks)

    def load(self, host_block: int, device_block: int) -> None:
        """A host-tier hit (pinned first): copy host_block to device_block in this step."""
        self.blocks_to_swap_in.append((host_block, device_block))
        self.num_host_hits += 1
        self.num_blocks_swapped_in += 1

    # ---- one step ---------------------------------------------------------------------------
    def take_copies(self, so) -> None:
        """Move the pending copies into an executed step's SchedulerOutput and unpin the host
        blocks their swap-ins read (later steps run after these copies)."""
        so.blocks_to_swap_out, self.blocks_to_swap_out = self.blocks_to_swap_out, []
        so.blocks_to_swap_in, self.blocks_to_swap_in = self.blocks_to_swap_in, []
        so.blocks_to_copy, self.blocks_to_copy = self.blocks_to_copy, []
        pinned, self._pinned = self._pinned, []
        self.pool.free_blocks(pinned)

    def check_invariants(self) -> None:
        """ref_cnt of each host block = swapped requests holding it + pins (tests)."""
        self.pool.check_invariants()
        held = [0] * self.pool.num_blocks
        for blocks in self.req_to_blocks.values():
            for b in blocks:
                held[b] += 1
        for b in self._pinned:
            held[b] += 1
        assert held == self.pool.ref_cnt, (held, self.pool.ref_cnt)
