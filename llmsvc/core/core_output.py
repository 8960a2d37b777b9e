"""EngineCoreOutput: what the scheduler reports per request per step (token ids, no text)."""
from __future__ import annotations

from dataclasses import dataclass

from llmsvc.wire import SampleLogprobs


@dataclass
class EngineCoreOutput:
    req_id: str
    new_token_ids: list[int]  # sampled this step ([] for a prompt chunk or a finish without token)
    new_logprobs: list[SampleLogprobs | None] | None = None  # one per new token, when asked
    new_prompt_logprobs: list[SampleLogprobs | None] | None = None  # positions computed this step
    finish_reason: str | None = None  # llmsvc.outputs strings; None while running
    stop_reason: int | str | None = None  # EOS / stop token id that finished it
    num_cached_tokens: int = 0
    first_scheduled_time: float | None = None
    num_preemptions: int = 0  # times this request was preempted so far (recomputed or swapped)
    num_swaps: int = 0  # of those, by swap: its KV blocks copied to the swap space and back
    num_draft_tokens: int = 0  # speculative decoding so far: draft tokens verified for this request
    num_accepted_tokens: int = 0  # of those, accepted (each one more token from its step)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
