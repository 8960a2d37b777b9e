"""Recompute-preemption for the Scheduler (torch-free).

A preempted request frees its KV blocks and goes back to the waiting queue, ahead of everything
of its rank, with num_computed_tokens = 0; when admitted again it restarts from its prefix-cache
hits. The Scheduler preempts when a running request cannot get the blocks for its next tokens,
and, under the priority policy, when a waiting request outranks a running one that keeps it from
being admitted.
"""
from __future__ import annotations

from llmsvc.core.request import Request, RequestStatus


class PreemptionMixin:
    """The Scheduler's preemption methods; they own no state. They use the Scheduler's config, kv,
    running, waiting, finished_req_ids and num_preemptions. _preempt takes a request already
    removed from running, frees its blocks, queues it ahead of the waiting requests of its rank
    and names it in finished_req_ids so the workers drop their cached state for it."""

    def _preempt_for_waiting(self) -> None:
        """Priority policy: while the best waiting request cannot be admitted (no seat, or too few
        free blocks to hold it whole, the scheduler's admission rule) and a running request ranks
        strictly below it by (priority, arrival_time), preempt the lowest-ranked running request."""
        while len(self.waiting) and self.running:
            head = self.waiting.peek()
            victim = self._pick_victim(self.running)
            if (victim.priority, victim.arrival_time) <= (head.priority, head.arrival_time):
                return
            if len(self.running) < self.config.max_num_seqs:
                hit_blocks, _ = self.kv.get_computed_blocks(head)
                if self.kv.can_hold(head, hit_blocks):
                    return
            self.running.remove(victim)
            self._preempt(victim)

    def _pick_victim(self, candidates: list[Request]) -> Request:
        """The request to preempt: the lowest-ranked by (priority, arrival_time) under the priority
        policy, else the latest arrival."""
        if self.config.policy == "priority":
            return max(candidates, key=lambda r: (r.priority, r.arrival_time))
        return max(candidates, key=lambda r: r.arrival_time)

    @staticmethod
    def _unschedule(req: Request, num_scheduled: dict, spec_tokens: dict, cached) -> int:
        """Take a request scheduled earlier in this step back out of it (before it is preempted);
        returns the tokens it had been given."""
        spec_tokens.pop(req.request_id, None)
        j = cached.req_ids.index(req.request_id)
        for column in (cached.req_ids, cached.new_token_ids, cached.new_block_ids, cached.num_computed_tokens):
            del column[j]
        return num_scheduled.pop(req.request_id)

    def _preempt(self, req: Request) -> None:
        self.kv.forget_uncomputed(req)  # blocks registered for this step's work, if it was unscheduled
        if self._swap_out(req):  # swap-preemption when there is a swap space with room (swap.py)
            return
        # async scheduling: a token still in flight is dropped and sampled again after the recompute
        # (same position, so the same token under greedy or a per-request seed), also when the
        # request is admitted again before that step's output comes
        req.num_stale_samples += req.num_output_placeholders
        req.discard_placeholders()
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.finished_req_ids.add(req.request_id)  # workers drop it; it comes back as a new request
        self.waiting.add_preempted(req)
