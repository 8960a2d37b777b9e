"""Per-request state a worker keeps between steps, rebuilt from SchedulerOutput diffs."""
from __future__ import annotations

from dataclasses import dataclass

from llmsvc.sampling_params import SamplingParams
from llmsvc.wire import CachedRequestData, NewRequestData, SchedulerOutput


@dataclass
class CachedRequestState:
    req_id: str
    prompt_len: int
    token_ids: list[int]  # prompt + outputs the scheduler has told us about
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len:]

    @classmethod
    def from_new(cls, r: NewRequestData) -> "CachedRequestState":
        return cls(r.req_id, len(r.prompt_token_ids), r.prompt_token_ids + r.output_token_ids,
                   r.sampling_params, list(r.block_ids), r.num_computed_tokens)


class RequestStates(dict):
    """req_id -> CachedRequestState; `apply(so)` folds one step's diff in, in wire.py's order."""

    def apply(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids:
            self.pop(req_id, None)
        for r in so.scheduled_new_reqs:
            self[r.req_id] = CachedRequestState.from_new(r)
        c: CachedRequestData = so.scheduled_cached_reqs
        for req_id, new_tokens, new_blocks, n in zip(c.req_ids, c.new_token_ids, c.new_block_ids,
                                                     c.num_computed_tokens):
            st = self[req_id]
            st.token_ids.extend(new_tokens)
            st.block_ids.extend(new_blocks)
            st.num_computed_tokens = n
