"""Per-request state a worker keeps between steps, rebuilt from SchedulerOutput diffs."""
from __future__ import annotations

from dataclasses import dataclass

from llmsvc.sampling_params import SamplingParams
from llmsvc.wire import PLACEHOLDER_TOKEN_ID, CachedRequestData, NewRequestData, SchedulerOutput


@dataclass
class CachedRequestState:
    req_id: str
    prompt_len: int
    token_ids: list[int]  # prompt + outputs the scheduler has told us about
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    lora_id: int = 0  # 0: base model; else LoRAConfig's adapter id (slot lora_id - 1)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len:]

    @classmethod
    def from_new(cls, r: NewRequestData) -> "CachedRequestState":
        return cls(r.req_id, len(r.prompt_token_ids), r.prompt_token_ids + r.output_token_ids,
                   r.sampling_params, list(r.block_ids), r.num_computed_tokens, r.lora_id)


class RequestStates(dict):
    """req_id -> CachedRequestState; `apply(so)` folds one step's diff in, in wire.py's order.

    prev_sampled: req_id -> the token this rank sampled for it in the last step it ran (rank 0
    only; async scheduling's placeholders stand for these)."""

    def __init__(self) -> None:
        super().__init__()
        self.prev_sampled: dict[str, int] = {}

    def fill_placeholders(self, so: SchedulerOutput) -> None:
        """Replace, in place, each PLACEHOLDER_TOKEN_ID of the step's new tokens by the token
        this rank sampled for that request in the previous step."""
        c = so.scheduled_cached_reqs
        for req_id, new_tokens in zip(c.req_ids, c.new_token_ids):
            if new_tokens and new_tokens[-1] == PLACEHOLDER_TOKEN_ID:
                new_tokens[-1] = self.prev_sampled[req_id]

    def apply(self, so: SchedulerOutput) -> None:
        self.fill_placeholders(so)
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
