"""AsyncScheduler: schedules step N+1 while step N still runs (async scheduling, torch-free).

The synchronous Scheduler advances a request's num_computed_tokens when a step's output comes
back, so the next step cannot be scheduled before it. This one advances it as soon as the step is
scheduled (after_schedule), and a request that samples in that step gets a placeholder output
token (PLACEHOLDER_TOKEN_ID). Step N+1 can then schedule the request's next decode at once: the
worker receives the placeholder and substitutes the token it sampled itself in step N.
update_from_output(N) replaces the oldest placeholder by the real token, applies the stop checks
on the known tokens, and a request that finishes drops its remaining placeholder; the work
step N+1 already holds for it is discarded when its output comes (the request is gone by then).

Invariants (per unfinished request): at most two placeholders (steps N and N+1 in flight), all
trailing; num_computed_tokens counts the tokens of every step scheduled so far; the placeholders
of step N are resolved before step N+2 is scheduled (EngineCore keeps a batch queue of depth 2),
so a placeholder sent to a worker always stands for the step just before, and a preempted request
(placeholders discarded) comes back with known tokens only.
"""
from __future__ import annotations

from llmsvc.core.request import Request
from llmsvc.core.scheduler import Scheduler
from llmsvc.wire import SchedulerOutput


class AsyncScheduler(Scheduler):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # id(SchedulerOutput) of each step in flight -> the Request objects it computes for: a
        # request finished meanwhile may have been replaced by a new one with the same id
        self._step_requests: dict[int, dict[str, Request]] = {}
        self._updating: dict[str, Request] = {}

    def after_schedule(self, scheduler_output: SchedulerOutput) -> None:
        step = self._step_requests[id(scheduler_output)] = {}
        for rid, n in scheduler_output.num_scheduled_tokens.items():
            req = step[rid] = self.requests[rid]
            req.num_computed_tokens += n
            self._count_prompt_tokens(req, n)
            if req.num_computed_tokens == req.num_tokens:  # samples in this step
                req.append_placeholder()

    def update_from_output(self, scheduler_output: SchedulerOutput, runner_output):
        self._updating = self._step_requests.pop(id(scheduler_output), {})
        return super().update_from_output(scheduler_output, runner_output)

    def _scheduled_request(self, scheduler_output: SchedulerOutput, req_id: str) -> Request | None:
        req = self._updating.get(req_id)
        return req if req is not None and self.requests.get(req_id) is req else None

    def _advance(self, req: Request, n: int) -> None:
        pass  # done in after_schedule

    def _record_token(self, req: Request, token: int) -> None:
        req.resolve_placeholder(token)
