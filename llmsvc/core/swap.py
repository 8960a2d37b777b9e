"""Swap-preemption and the host tier of the prefix cache, for the Scheduler (torch-free).

Three queues: waiting (new and recompute-preempted requests), running, and swapped (requests
whose KV blocks were copied to the swap space, llmsvc/core/swap_space.py). One swapped
request's path:
1. A running request r needs a block and the pool has none: the scheduler picks a victim v
   (PreemptionMixin). With a swap space that has room for v's computed blocks, `_swap_out(v)`
   queues (device, host) copies, frees v's device blocks, sets v SWAPPED and names it in
   finished_req_ids (workers drop its state, as for a recompute-preemption).
2. Each later step, after the running requests and before any waiting one, `_schedule_swapped`
   takes swapped requests in arrival order (under priority: by priority, then arrival) while
   the pool has room for their blocks and next tokens:
   its leading blocks still in the device's prefix cache are shared as hits, the rest get fresh
   device blocks and (host, device) copies, and v goes back to the workers as a new request
   whose num_computed_tokens is where it stopped; no token is recomputed but, at most, the last.
3. The worker runs the step's copies (out, in, copy) before its forward pass.

Resume is exact: v's known tokens and num_computed_tokens are kept; a sample still in flight
(async scheduling) is dropped and sampled again at the same position, as after a recompute;
drafts (speculative decoding) never entered its tokens; its grammar state follows its output
tokens; its adapter id travels in NewRequestData.

Host tier: a cached block the KV cache evicts is copied to the swap space under its hash
(BlockPool.on_evict); before a waiting request is admitted, the hashes after its device hits are
looked up there, and each one found is copied to a fresh device block registered under that
hash, so the admission finds it as an ordinary prefix-cache hit.
"""
from __future__ import annotations

import bisect

from llmsvc.core.kv_cache_manager import cdiv
from llmsvc.core.request import Request, RequestStatus
from llmsvc.core.swap_space import SwapSpace
from llmsvc.wire import NewRequestData, SchedulerOutput


class SwapMixin:
    """The Scheduler's swap methods. They use its kv, config, running, requests, finished_req_ids,
    num_preemptions, and own `swap` (None: no swap space), `swap_preemption` and `swapped`."""

    swap: SwapSpace | None = None
    swap_preemption = False
    swapped: list[Request]

    def attach_swap_space(self, swap: SwapSpace, preemption_mode: str = "auto") -> None:
        """Use `swap` for swap-preemption (preemption_mode auto or swap) and as the host tier of
        the prefix cache (when prefix caching is on)."""
        self.swap = swap
        # a released sliding-window block is no longer the request's: nothing to swap back in
        self.swap_preemption = preemption_mode != "recompute" and not self.kv.sliding_window
        if self.kv.enable_caching:
            self.kv.pool.on_evict = swap.store_evicted
            self.kv.pool.on_reset = swap.forget_tier

    # ---- out ---------------------------------------------------------------------------------
    def _swap_out(self, req: Request) -> bool:
        """Preempt a running request (already out of `running`) by swapping its computed blocks
        out. False (nothing changed) when swap is off, the swap space lacks room, or nothing of
        it is computed: the caller recomputes instead."""
        if not self.swap_preemption:
            return False
        num_known = req.num_known_tokens
        # resume computes at least its last known token again: that step samples the next one
        num_computed = min(req.num_computed_tokens, num_known - 1)
        num_blocks = cdiv(num_computed, self.kv.block_size)
        if num_blocks == 0 or num_blocks > self.swap.num_free_blocks:
            return False
        # async scheduling: a token still in flight is dropped and sampled again on resume
        req.num_stale_samples += req.num_output_placeholders
        req.discard_placeholders()
        blocks = self.kv.get_block_ids(req.request_id)[:num_blocks]
        num_full = num_computed // self.kv.block_size
        self.swap.swap_out(req.request_id, blocks, req.block_hashes[:num_full] if self.kv.enable_caching else [])
        self.kv.free(req)
        req.num_computed_tokens = num_computed
        req.status = RequestStatus.SWAPPED
        req.num_preemptions += 1
        req.num_swaps += 1
        self.num_preemptions += 1
        self.finished_req_ids.add(req.request_id)  # workers drop it; it comes back as a new request
        # the queue stays in the order it resumes in: arrival, or (priority, arrival) under priority
        # (in swap-out order a later arrival, swapped out first, came back first)
        bisect.insort(self.swapped, req, key=self._swap_rank)
        return True

    def _swap_rank(self, req: Request) -> tuple:
        return (req.priority, req.arrival_time) if self.config.policy == "priority" else (req.arrival_time,)

    # ---- in ----------------------------------------------------------------------------------
    def _swapped_first(self) -> bool:
        """Whether the swapped queue's head (its first to resume, `_swap_rank`) goes before any
        waiting request: always under FCFS (it arrived first and holds host memory); under
        priority when it ranks at least as high."""
        if not self.swapped:
            return False
        if self.config.policy != "priority" or not len(self.waiting):
            return True
        head, w = self.swapped[0], self.waiting.peek()
        return (head.priority, head.arrival_time) <= (w.priority, w.arrival_time)

    def _schedule_swapped(self, budget: int, num_scheduled: dict, new_reqs: list, now: float) -> int:
        """Swap requests back in, in order, while seats, budget and device blocks allow; each is
        scheduled in this step as a new request. Returns the budget left."""
        chunked = self.config.enable_chunked_prefill
        while (self.swapped and budget > 0 and len(self.running) < self.config.max_num_seqs
               and self._swapped_first()):
            req = self.swapped[0]
            num_new = req.num_tokens - req.num_computed_tokens
            if num_new > budget and not chunked:
                break
            num_new = min(num_new, budget)
            num_host = len(self.swap.req_to_blocks[req.request_id])
            got = self.kv.allocate_swapped_in(req, num_host, num_new)
            if got is None:
                break
            blocks, num_hits = got  # leading blocks still cached on the device: nothing to copy
            self.swapped.pop(0)
            self.swap.swap_in(req.request_id, blocks[:num_host], num_hits)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            num_scheduled[req.request_id] = num_new
            budget -= num_new
            new_reqs.append(NewRequestData.from_request(req, blocks))
            req.num_output_tokens_sent = req.num_output_tokens
        return budget

    # ---- host tier ---------------------------------------------------------------------------
    def _load_host_hits(self, req: Request) -> None:
        """Before a waiting request's prefix lookup: copy the host-tier blocks that extend its
        device hits back to the device (registered there under their hashes), as many as the
        pool can spare beside the rest of the request."""
        if self.swap is None or not self.kv.enable_caching or req.sampling_params.prompt_logprobs is not None:
            return
        hits, _ = self.kv.get_computed_blocks(req)  # also extends req.block_hashes
        max_blocks = (req.num_tokens - 1) // self.kv.block_size
        found = []
        for h in req.block_hashes[len(hits):max_blocks]:
            host = self.swap.lookup(h)
            if host is None:
                break
            found.append((h, host))
        if not found:
            return
        # blocks the request needs beyond its device hits; room for them all, or none are loaded
        need = cdiv(req.num_tokens, self.kv.block_size) - len(hits)
        if need > self.kv.num_free_blocks_besides(hits):
            return
        # hold what the loads must not evict while they allocate: the host blocks they read (a
        # device eviction stores into the host tier's LRU block) and the device hits they extend
        self.swap.pin([host for _, host in found])
        self.kv.pool.touch(hits)
        bs = self.kv.block_size
        for i, (h, host) in enumerate(found, start=len(hits)):
            parent = req.block_hashes[i - 1] if i else None
            self.swap.load(host, self.kv.load_cached_block(h, parent, req.all_token_ids[i * bs:(i + 1) * bs]))
        self.kv.pool.free_blocks(reversed(hits))

    # ---- the step's copies -------------------------------------------------------------------
    def _attach_copies(self, so: SchedulerOutput) -> None:
        if self.swap is not None and so.total_num_scheduled_tokens > 0:
            self.swap.take_copies(so)

    def _finish_swapped(self, req: Request) -> None:
        """A swapped request finishes (abort, deadline): out of the queue, host blocks freed."""
        self.swapped.remove(req)
        self.swap.free(req.request_id)

    @property
    def num_swapped(self) -> int:
        return len(self.swapped)

