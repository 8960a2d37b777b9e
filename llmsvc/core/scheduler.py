"""Scheduler: continuous batching under a per-step token budget (vLLM v1 style, torch-free)."""
from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from llmsvc.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from llmsvc.core.errors import PromptTooLongError
from llmsvc.core.grammar_wait import GrammarWaitMixin
from llmsvc.core.kv_cache_manager import KVCacheManager
from llmsvc.core.preemption import PreemptionMixin
from llmsvc.core.request import Request, RequestStatus
from llmsvc.core.request_queue import create_request_queue
from llmsvc.core.scheduler_update import UpdateMixin
from llmsvc.core.spec_decode import Speculator
from llmsvc.core.swap import SwapMixin
from llmsvc.wire import CachedRequestData, NewRequestData, SchedulerOutput


@dataclass
class _Step:
    """What schedule() has decided so far in one step."""

    budget: int  # tokens left of max_num_batched_tokens
    num_scheduled: dict[str, int] = field(default_factory=dict)
    spec_tokens: dict[str, list[int]] = field(default_factory=dict)
    new_reqs: list[NewRequestData] = field(default_factory=list)
    cached: CachedRequestData = field(default_factory=CachedRequestData.make_empty)
    preempted: bool = False
    decode_only: bool = True  # every request scheduled decodes (the draft governor times those steps)
    now: float = field(default_factory=time.time)


class Scheduler(PreemptionMixin, SwapMixin, GrammarWaitMixin, UpdateMixin):
    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                 kv_cache_manager: KVCacheManager, max_model_len: int,
                 speculative_config: SpeculativeConfig | None = None) -> None:
        self.config = scheduler_config
        self.kv = kv_cache_manager
        # a request never holds more tokens than the context nor than the whole pool (with
        # sliding windows: than a window and a step, spec-decode drafts included)
        step_tokens = scheduler_config.max_num_batched_tokens + (
            speculative_config.num_speculative_tokens if speculative_config else 0)
        self.pool_max_len = kv_cache_manager.max_request_tokens(step_tokens)  # None: the pool sets no bound
        self.max_len = min(max_model_len, self.pool_max_len or max_model_len)
        if not scheduler_config.enable_chunked_prefill:  # a (re)computed request must fit one step
            self.max_len = min(self.max_len, scheduler_config.max_num_batched_tokens)
        self.max_model_len = max_model_len
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.waiting = create_request_queue(scheduler_config.policy)
        self.running: list[Request] = []
        self.swapped: list[Request] = []  # preempted by swap, in order (swap.py; attach_swap_space)
        # structured output: admitted requests whose grammar still compiles; queued once ready
        self.waiting_for_fsm: list[Request] = []
        self._grammar_failed: list[Request] = []  # finished at promotion; reported next update
        self.finished_req_ids: set[str] = set()  # to tell the workers on the next executed step
        self.num_preemptions = 0
        self.prompt_tokens_total = 0  # prompt tokens computed (cache hits excluded)
        self.generation_tokens_total = 0
        self.speculator = Speculator(speculative_config) if speculative_config else None  # None: off

    # ---- admission -------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise KeyError(f"request {request.request_id!r} already in the scheduler")
        if request.num_prompt_tokens >= self.max_len:
            what = ("the KV cache pool" if self.max_len < self.max_model_len
                    else "the maximum context length")
            raise PromptTooLongError(request.num_prompt_tokens, self.max_len, what)
        # a constraint that already failed to compile (cached) raises ConstraintError here
        ready = request.structured is None or request.structured.poll()
        request.max_len = self.max_len
        self.requests[request.request_id] = request
        if ready:
            request.status = RequestStatus.WAITING
            self.waiting.add(request)
        else:
            request.status = RequestStatus.WAITING_FOR_FSM
            self.waiting_for_fsm.append(request)

    def finish_requests(self, request_ids: Iterable[str], reason: str) -> list[Request]:
        """Finish (abort, or stop-string from the output processor) unfinished requests.

        Unknown or already finished ids are ignored. Returns the requests finished."""
        status = RequestStatus.from_finish_reason(reason)
        done = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None:
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            elif req.status == RequestStatus.WAITING_FOR_FSM:
                self.waiting_for_fsm.remove(req)
            elif req.status == RequestStatus.SWAPPED:
                self._finish_swapped(req)
            else:
                self.waiting.remove(req)
            req.status = status
            self._free(req)
            done.append(req)
        return done

    def _free(self, req: Request) -> None:
        self.kv.free(req)
        del self.requests[req.request_id]
        self.finished_req_ids.add(req.request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ---- scheduling ------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        # Invariant: there are no prefill or decode phases. Each step has a token budget; every
        # scheduled request computes the next num_scheduled_tokens of its tokens so that its
        # num_computed_tokens catches up with its num_tokens (prompt + output). A prompt longer
        # than the budget is computed in chunks over several steps (chunked prefill), prefix-cache
        # hits start a request with num_computed_tokens > 0, and a preempted request restarts
        # from its cache hits (recompute) or its swapped blocks. Running requests go first, then
        # swapped ones, then waiting ones.
        if self.waiting_for_fsm:
            self._promote_ready_grammars()
        step = _Step(self.config.max_num_batched_tokens)
        if self.config.policy == "priority":
            self._preempt_for_waiting()
        self._schedule_running(step)
        if self.swapped and not step.preempted:
            step.budget = self._schedule_swapped(step.budget, step.num_scheduled, step.new_reqs, step.now)
        if not step.preempted:  # no admissions in a step that had to preempt: the pool is under pressure
            self._schedule_waiting(step)
        total = sum(step.num_scheduled.values())
        if self.speculator is not None:
            self.speculator.scheduled(bool(step.spec_tokens), step.decode_only and not step.new_reqs)
        finished = set(self.finished_req_ids)
        if total > 0:  # otherwise nothing runs; keep them for the next executed step
            self.finished_req_ids.clear()
        so = SchedulerOutput(step.new_reqs, step.cached, step.num_scheduled, total, finished,
                             scheduled_spec_decode_tokens=step.spec_tokens)
        self._attach_copies(so)
        return so

    def _schedule_running(self, step: "_Step") -> None:
        chunked = self.config.enable_chunked_prefill
        draft = self.speculator is not None and self.speculator.enabled(len(self.running))
        i = 0
        while i < len(self.running) and step.budget > 0:
            req = self.running[i]
            num_new = req.num_tokens - req.num_computed_tokens
            if (num_new > step.budget and not chunked) or (
                    req.num_output_placeholders and self._finishes_in_flight(req)):
                i += 1
                continue
            num_new = min(num_new, step.budget)
            assert num_new > 0, req
            step.decode_only = step.decode_only and num_new == 1
            drafts = self.speculator.propose(req, step.budget, self.max_len) if draft and num_new == 1 else []
            new_blocks, drafts, i = self._allocate_or_preempt(req, i, num_new, drafts, step)
            if new_blocks is None:
                continue  # req itself was preempted; running[i] is now the next one
            if drafts:
                step.spec_tokens[req.request_id] = drafts
                num_new += len(drafts)
            step.num_scheduled[req.request_id] = num_new
            step.budget -= num_new
            cached = step.cached
            cached.req_ids.append(req.request_id)
            cached.new_token_ids.append(req.output_token_ids[req.num_output_tokens_sent:])
            cached.new_block_ids.append(new_blocks)
            cached.num_computed_tokens.append(req.num_computed_tokens)
            req.num_output_tokens_sent = req.num_output_tokens
            i += 1

    def _allocate_or_preempt(self, req: Request, i: int, num_new: int, drafts: list[int], step: "_Step"):
        """Blocks for running[i]'s next num_new tokens (+ drafts), preempting others until they
        fit. Returns (new block ids or None when req itself was preempted, the drafts kept, i
        corrected for victims taken back out of this step)."""
        while True:
            new_blocks = self.kv.allocate_slots(req, num_new, num_lookahead_tokens=len(drafts))
            if new_blocks is not None:
                return new_blocks, drafts, i
            if drafts:  # no room for the drafts: decode one token as usual
                drafts = []
                continue
            # preemption: the lowest-ranked running request under priority (taken back out of this
            # step if it was scheduled already), else the newest of those not scheduled yet
            victim = self._pick_victim(self.running if self.config.policy == "priority" else self.running[i:])
            if self.running.index(victim) < i:
                i -= 1
                # a request passed over above (no room in the budget, or under async scheduling one
                # that finishes with its token in flight) was never scheduled: nothing to take back
                if victim.request_id in step.num_scheduled:
                    step.budget += self._unschedule(victim, step.num_scheduled, step.spec_tokens, step.cached)
            self.running.remove(victim)
            self._preempt(victim)
            step.preempted = True
            if victim is req:
                return None, [], i

    def _schedule_waiting(self, step: "_Step") -> None:
        chunked = self.config.enable_chunked_prefill
        admission_budget = step.budget  # what this step's running work left
        while (len(self.waiting) and step.budget > 0 and len(self.running) < self.config.max_num_seqs
               and not self._swapped_first()):
            req = self.waiting.peek()
            self._load_host_hits(req)
            hit_blocks, num_hit = self.kv.get_computed_blocks(req)
            if self.running and not self.kv.can_hold(req, hit_blocks):
                # Beside running requests, a prompt is admitted only when it fits whole: admitted
                # on its first chunk's blocks, it computed chunks that their growth then took back
                # by preemption, step after step, until they finished (nothing to resume from
                # with prompt logprobs or without prefix caching). It waits for them instead.
                break
            num_new = req.num_tokens - num_hit
            if num_new > step.budget and (not chunked or num_new <= admission_budget):
                # The second case: an earlier admission of this step took the budget this prompt
                # needed, and a step carrying only this step's running work takes it whole. It
                # then waits one step instead of being split: a partial chunk would lengthen this
                # step, delaying every first token it yields, and finish the prompt no sooner.
                break
            num_new = min(num_new, step.budget)
            if self.kv.allocate_slots(req, num_new, hit_blocks) is None:
                break
            self.waiting.pop()
            self._admit(req, num_hit, num_new, step)

    def _admit(self, req: Request, num_hit: int, num_new: int, step: "_Step") -> None:
        req.num_computed_tokens = num_hit
        if req.num_cached_tokens < 0:  # first admission: its prompt is a lookup (a resumed one is not)
            req.num_cached_tokens = num_hit
            self.kv.record_lookup(req.num_tokens, num_hit)
        if req.first_scheduled_time is None:
            req.first_scheduled_time = step.now
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        step.num_scheduled[req.request_id] = num_new
        step.budget -= num_new
        step.new_reqs.append(NewRequestData.from_request(req, self.kv.get_block_ids(req.request_id)))
        req.num_output_tokens_sent = req.num_output_tokens

    # ---- async scheduling hooks (no-ops here; llmsvc.core.async_scheduler) -------------------
    def after_schedule(self, scheduler_output: SchedulerOutput) -> None:
        """Called once the step's grammar bitmask is attached, before the step is submitted."""

    def _finishes_in_flight(self, req: Request) -> bool:
        """A request whose in-flight tokens already reach max_tokens or max_len will finish when
        they resolve: scheduling it again would only compute a token that is dropped."""
        return ((req.max_tokens is not None and req.num_output_tokens >= req.max_tokens)
                or req.num_tokens >= self.max_len)

    def _advance(self, req: Request, n: int) -> None:
        """The step computed n more tokens of req."""
        req.num_computed_tokens += n
        self._count_prompt_tokens(req, n)

    def _count_prompt_tokens(self, req: Request, n: int) -> None:
        """req.num_computed_tokens has just grown by n: count the prompt tokens among them."""
        before = req.num_computed_tokens - n
        if before < req.num_prompt_tokens:
            self.prompt_tokens_total += min(req.num_computed_tokens, req.num_prompt_tokens) - before

    def _record_token(self, req: Request, token: int) -> None:
        req.append_output_token_ids(token)

    def _scheduled_request(self, scheduler_output: SchedulerOutput, req_id: str) -> Request | None:
        """The unfinished request the step computed for req_id (None: finished since)."""
        return self.requests.get(req_id)

    # ---- observability ---------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.waiting_for_fsm)
