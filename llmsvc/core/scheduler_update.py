"""Folding a step's results back into the scheduler's requests (Scheduler.update_from_output).

The mixin keeps no state of its own; it uses the Scheduler's requests, running queue, speculator,
counters and the hooks `_scheduled_request`, `_advance`, `_record_token`, `_free`,
`finish_requests` (async scheduling overrides some of them).
"""
from __future__ import annotations

import time

from llmsvc import outputs
from llmsvc.core.core_output import EngineCoreOutput
from llmsvc.core.request import Request, RequestStatus
from llmsvc.core.stop import check_stop, fresh_prompt_logprobs, grammar_complete, grammar_rejects, no_token_left
from llmsvc.wire import ModelRunnerOutput, SchedulerOutput


class UpdateMixin:
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
                self.speculator.observe(req, len(drafts), len(tokens) - 1)
            self._advance(req, n)
            prompt_lp = fresh_prompt_logprobs(req, runner_output.prompt_logprobs.get(rid))
            if k is None:
                if prompt_lp:
                    out.append(self._output(req, [], None, prompt_lp))
                continue
            lps = None
            if runner_output.logprobs is not None and req.sampling_params.logprobs is not None:
                lps = runner_output.logprobs[k]
            kept, dead_at = 0, runner_output.no_token.get(rid)
            for token in tokens:  # an accepted draft may end the request: the rest are dropped
                if (kept == dead_at and no_token_left(req)) or grammar_rejects(req, token):
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
            num_draft_tokens=req.num_draft_tokens,
            num_accepted_tokens=req.num_accepted_tokens,
        )
