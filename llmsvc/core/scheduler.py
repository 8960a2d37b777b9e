"""Scheduler: continuous batching under a per-step token budget (vLLM v1 style, torch-free)."""
from __future__ import annotations

import time
from collections.abc import Iterable

from llmsvc import outputs
from llmsvc.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from llmsvc.core.core_output import EngineCoreOutput
from llmsvc.core.errors import PromptTooLongError
from llmsvc.core.grammar_wait import GrammarWaitMixin
from llmsvc.core.kv_cache_manager import KVCacheManager
from llmsvc.core.preemption import PreemptionMixin
from llmsvc.core.request import Request, RequestStatus
from llmsvc.core.request_queue import create_request_queue
from llmsvc.core.spec_decode import Speculator
from llmsvc.core.swap import SwapMixin
from llmsvc.core.stop import check_stop, fresh_prompt_logprobs, grammar_complete, grammar_rejects
from llmsvc.wire import CachedRequestData, ModelRunnerOutput, NewRequestData, SchedulerOutput


class Scheduler(PreemptionMixin, SwapMixin, GrammarWaitMixin):
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
        # from its cache hits (recompute). Running requests go first, then waiting ones.
        if self.waiting_for_fsm:
            self._promote_ready_grammars()
        budget = self.config.max_num_batched_tokens
        chunked = self.config.enable_chunked_prefill
        num_scheduled: dict[str, int] = {}
        spec_tokens: dict[str, list[int]] = {}
        draft = self.speculator is not None and self.speculator.enabled(len(self.running))
        decode_only = True  # every request scheduled decodes (the draft governor times those steps)
        new_reqs: list[NewRequestData] = []
        cached = CachedRequestData.make_empty()
        preempted = False
        now = time.time()
        if self.config.policy == "priority":
            self._preempt_for_waiting()

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = req.num_tokens - req.num_computed_tokens
            if (num_new > budget and not chunked) or (req.num_output_placeholders and self._finishes_in_flight(req)):
                i += 1
                continue
            num_new = min(num_new, budget)
            assert num_new > 0, req
            decode_only = decode_only and num_new == 1
            drafts = self.speculator.propose(req, budget, self.max_len) if draft and num_new == 1 else []
            while True:
                new_blocks = self.kv.allocate_slots(req, num_new, num_lookahead_tokens=len(drafts))
                if new_blocks is not None:
                    break
                if drafts:  # no room for the drafts: decode one token as usual
                    drafts = []
                    continue
                # recompute-preemption: the lowest-ranked running request under priority (taken
                # back out of this step if it was scheduled already), else the newest of those
                # not scheduled yet
                victim = self._pick_victim(self.running if self.config.policy == "priority" else self.running[i:])
                if self.running.index(victim) < i:
                    i -= 1
                    budget += self._unschedule(victim, num_scheduled, spec_tokens, cached)
                self.running.remove(victim)
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            if new_blocks is None:
                continue  # req itself was preempted; running[i] is now the next one
            if drafts:
                spec_tokens[req.request_id] = drafts
                num_new += len(drafts)
            num_scheduled[req.request_id] = num_new
            budget -= num_new
            cached.req_ids.append(req.request_id)
            cached.new_token_ids.append(req.output_token_ids[req.num_output_tokens_sent:])
            cached.new_block_ids.append(new_blocks)
            cached.num_computed_tokens.append(req.num_computed_tokens)
            req.num_output_tokens_sent = req.num_output_tokens
            i += 1

        if self.swapped and not preempted:
            budget = self._schedule_swapped(budget, num_scheduled, new_reqs, now)
        admission_budget = budget  # what this step's running work left
        # no admissions in a step that had to preempt: the pool is under pressure
        while (not preempted and len(self.waiting) and budget > 0
               and len(self.running) < self.config.max_num_seqs and not self._swapped_first()):
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
            if num_new > budget and (not chunked or num_new <= admission_budget):
                # The second case: an earlier admission of this step took the budget this prompt
                # needed, and a step carrying only this step's running work takes it whole. It
                # then waits one step instead of being split: a partial chunk would lengthen this
                # step, delaying every first token it yields, and finish the prompt no sooner.
                break
            num_new = min(num_new, budget)
            if self.kv.allocate_slots(req, num_new, hit_blocks) is None:
                break
            self.waiting.pop()
            req.num_computed_tokens = num_hit
            if req.num_cached_tokens < 0:  # first admission: its prompt is a lookup (a resumed one is not)
                req.num_cached_tokens = num_hit
                self.kv.record_lookup(req.num_tokens, num_hit)
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            num_scheduled[req.request_id] = num_new
            budget -= num_new
            new_reqs.append(NewRequestData.from_request(req, self.kv.get_block_ids(req.request_id)))
            req.num_output_tokens_sent = req.num_output_tokens

        total = sum(num_scheduled.values())
        if self.speculator is not None:
            self.speculator.scheduled(bool(spec_tokens), decode_only and not new_reqs)
        finished = set(self.finished_req_ids)
        if total > 0:  # otherwise nothing runs; keep them for the next executed step
            self.finished_req_ids.clear()
        so = SchedulerOutput(new_reqs, cached, num_scheduled, total, finished,
                             scheduled_spec_decode_tokens=spec_tokens)
        self._attach_copies(so)
        return so

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

    # ---- results ---------------------------------------------------------------------------
    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Advance num_computed_tokens, append sampled tokens, apply the stop conditions that
        need no text, and report per request. Finished requests free their blocks here."""
        index = {rid: k for k, rid in enumerate(runner_output.req_ids)}
        out: list[EngineCoreOutput] = []
        stopped: list[Request] = []
        for rid, n in scheduler_output.num_scheduled_tokens.items():
            req = self._scheduled_request(scheduler_output, rid)
            if req is not None and req.num_stale_samples and rid in index:
                req.num_stale_samples -= 1  # sampled before the request was preempted
                continue
            if req is None or req.status != RequestStatus.RUNNING:
                continue  # finished or preempted meanwhile
            k = index.get(rid)
            tokens = runner_output.sampled_token_ids[k] if k is not None else []
            drafts = scheduler_output.scheduled_spec_decode_tokens.get(rid)
            if drafts:  # the rejected drafts' positions are computed again next step
                n -= len(drafts) + 1 - len(tokens)
                self.speculator.observe(len(drafts), len(tokens) - 1)
            self._advance(req, n)
            prompt_lp = fresh_prompt_logprobs(req, runner_output.prompt_logprobs.get(rid))
            if k is None:
                if prompt_lp:
                    out.append(self._output(req, [], None, prompt_lp))
                continue
            lps = None
            if runner_output.logprobs is not None and req.sampling_params.logprobs is not None:
                lps = runner_output.logprobs[k]
            kept = 0
            for token in tokens:  # an accepted draft may end the request: the rest are dropped
                if grammar_rejects(req, token):
                    stopped.append(req)
                    break
                kept += 1
                self._record_token(req, token)
                self.generation_tokens_total += 1
                if check_stop(req, token, self.max_len) or grammar_complete(req):
                    stopped.append(req)
                    break
            out.append(self._output(req, tokens[:kept], lps[:kept] if lps is not None else None, prompt_lp))
        for req in stopped:
            req.discard_placeholders()  # async: a next step already scheduled computes in vain
            self.running.remove(req)
            self._free(req)
        out.extend(self._expire(time.monotonic()))
        if self._grammar_failed:
            out.extend(self._output(r, [], None, None) for r in self._grammar_failed)
            self._grammar_failed = []
        return out

    def _expire(self, now: float) -> list[EngineCoreOutput]:
        """Finish every unfinished request past its time_limit_ms deadline (output kept)."""
        expired = [r.request_id for r in self.requests.values() if r.deadline is not None and now >= r.deadline]
        return [self._output(r, [], None, None) for r in self.finish_requests(expired, outputs.TIME_LIMIT)]

    def _output(self, req: Request, tokens: list[int], lp, prompt_lp) -> EngineCoreOutput:
        return EngineCoreOutput(
            req_id=req.request_id,
            new_token_ids=tokens,
            new_logprobs=lp,
            new_prompt_logprobs=prompt_lp,
            finish_reason=req.get_finished_reason(),
            stop_reason=req.stop_reason,
            num_cached_tokens=max(req.num_cached_tokens, 0),
            first_scheduled_time=req.first_scheduled_time,
            num_preemptions=req.num_preemptions,
            num_swaps=req.num_swaps,
        )

    # ---- observability ---------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.waiting_for_fsm)
