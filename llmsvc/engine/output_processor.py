"""OutputProcessor: engine-core outputs (token ids) -> RequestOutputs (text) for the front ends.

A user request with n > 1 is a ParentRequest fanned out into n child requests in the engine core
(child ids `"{index}_{request_id}"`); their outputs come back per CompletionOutput.index. Output
kinds: DELTA carries only what is new since the last output, CUMULATIVE everything so far,
FINAL_ONLY one output when every child finished.

Stream interval (DELTA and CUMULATIVE): an output goes out at a request's first token, when a
child finishes, and otherwise once some child holds `stream_interval` tokens not yet sent; in
between, nothing is built or handed to the front end, which saves the per-request work of each
step (stream wake-up, response message, its write) at the cost of coarser streaming.
"""
from __future__ import annotations

import dataclasses
import time

from llmsvc.core.core_output import EngineCoreOutput
from llmsvc.engine.request_state import RequestState
from llmsvc.engine.validation import MAX_SEED
from llmsvc.outputs import ABORT, RequestMetrics, RequestOutput
from llmsvc.sampling_params import RequestOutputKind, SamplingParams


def child_request_id(request_id: str, index: int, n: int) -> str:
    return request_id if n == 1 else f"{index}_{request_id}"


def child_sampling_params(params: SamplingParams, index: int) -> SamplingParams:
    """n=1 copy of the parent's params; seeded children get distinct seeds, (seed + index) mod
    MAX_SEED: each reported seed is one a request may send back."""
    if params.n == 1:
        return params
    seed = None if params.seed is None else (params.seed + index) % MAX_SEED
    return dataclasses.replace(params, n=1, seed=seed)


class ParentRequest:
    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams, tokenizer, arrival_time: float, stream_interval: int = 1) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.kind = params.output_kind
        # the request may ask for a larger interval than the engine's, never a smaller one
        self.stream_interval = max(stream_interval, params.stream_interval or 1)
        self.metrics = RequestMetrics(arrival_time=arrival_time)
        self.children = [
            RequestState(child_request_id(request_id, i, params.n), i, prompt_token_ids,
                         child_sampling_params(params, i), tokenizer)
            for i in range(params.n)
        ]

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.children)

    def make_output(self) -> RequestOutput | None:
        """The RequestOutput for what changed since the last call (None: nothing to send)."""
        children = self.children
        changed = [c for c in children if c.changed]
        if not changed:
            return None
        finished = all(c.finished for c in children)
        if self.kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        if self.stream_interval > 1 and not finished and not self._interval_due(changed):
            return None  # `changed` stays set: the next output carries these tokens too
        m = self.metrics
        preemptions = swaps = drafts = accepted = 0
        for c in children:
            m.first_scheduled_time = _min(m.first_scheduled_time, c.first_scheduled_time)
            m.first_token_time = _min(m.first_token_time, c.first_token_time)
            m.last_token_time = _max(m.last_token_time, c.last_token_time)
            preemptions += c.num_preemptions
            swaps += c.num_swaps
            drafts += c.num_draft_tokens
            accepted += c.num_accepted_tokens
        m.num_preemptions, m.num_swaps = preemptions, swaps
        m.num_draft_tokens, m.num_accepted_tokens = drafts, accepted
        if finished:
            m.finished_time = time.time()
        shown = changed if self.kind == RequestOutputKind.DELTA else children
        first = children[0]
        return RequestOutput(
            self.request_id, self.prompt, self.prompt_token_ids, [c.make_output(self.kind) for c in shown],
            finished, first.num_cached_tokens, first.take_prompt_logprobs(self.kind),
            # a snapshot: this object keeps changing while the output waits in a stream
            RequestMetrics(m.arrival_time, m.first_scheduled_time, m.first_token_time, m.last_token_time,
                           m.finished_time, m.num_preemptions, m.num_swaps, m.num_draft_tokens,
                           m.num_accepted_tokens),
            abort_reason=next((c.abort_reason for c in children if c.abort_reason), ""),
            seed=self.params.seed,
        )

    def _interval_due(self, changed: list[RequestState]) -> bool:
        for c in changed:
            unsent = len(c.token_ids) - c.sent_tokens
            if c.finished or (c.sent_tokens == 0 and unsent) or unsent >= self.stream_interval:
                return True
        return False


def _min(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None or a <= b else b


def _max(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None or a >= b else b


class OutputProcessor:
    def __init__(self, tokenizer, stream_interval: int = 1) -> None:
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {stream_interval}")
        self.tokenizer = tokenizer
        self.stream_interval = stream_interval  # the engine's floor for ParentRequest's
        self.parents: dict[str, ParentRequest] = {}  # user request id -> state
        self.child_to_parent: dict[str, tuple[ParentRequest, RequestState]] = {}
        self._pending: list[ParentRequest] = []  # finished outside a step (aborts): reported next

    def add_request(self, parent: ParentRequest) -> None:
        self.parents[parent.request_id] = parent
        for c in parent.children:
            self.child_to_parent[c.req_id] = (parent, c)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.parents

    def has_unfinished(self) -> bool:
        return bool(self.parents) or bool(self._pending)

    def get_num_unfinished(self) -> int:
        return len(self.parents)

    def child_ids(self, request_id: str) -> list[str]:
        parent = self.parents.get(request_id)
        return [] if parent is None else [c.req_id for c in parent.children if not c.finished]

    def abort(self, request_ids, reason: str = ABORT) -> list[str]:
        """Finish these user requests with `reason`; return the child ids to finish in the core.
        Their final outputs come out of the next `process_outputs`."""
        child_ids = []
        for rid in request_ids:
            parent = self.parents.get(rid)
            if parent is None:
                continue
            for c in parent.children:
                if not c.finished:
                    child_ids.append(c.req_id)
                    c.finish(reason)
            self._pending.append(parent)
        return child_ids

    def process_outputs(self, core_outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Returns (RequestOutputs, child ids a stop string finished: finish them in the core)."""
        now = time.time()
        touched: dict[str, ParentRequest] = {p.request_id: p for p in self._pending}
        self._pending.clear()
        stop_finished: list[str] = []
        for out in core_outputs:
            entry = self.child_to_parent.get(out.req_id)
            if entry is None:
                continue
            parent, child = entry
            if child.process(out, now):
                stop_finished.append(out.req_id)
            touched[parent.request_id] = parent
        results = []
        for parent in touched.values():
            ro = parent.make_output()
            if ro is not None:
                results.append(ro)
                if ro.finished:
                    self._remove(parent)
            elif parent.finished:
                self._remove(parent)
        return results, stop_finished

    def _remove(self, parent: ParentRequest) -> None:
        self.parents.pop(parent.request_id, None)
        for c in parent.children:
            self.child_to_parent.pop(c.req_id, None)
