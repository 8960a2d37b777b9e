"""Request: the engine's per-request state (torch-free).

Token layout: all_token_ids = prompt_token_ids + output_token_ids; num_tokens = len(all_token_ids).
Invariant while not finished: num_computed_tokens <= num_tokens; when RUNNING and not mid-prefill,
num_computed_tokens == num_tokens - 1 (the last sampled token is computed next step).
Async scheduling: the last num_output_placeholders output tokens are PLACEHOLDER_TOKEN_ID, tokens
of steps still in flight (at most two); they are replaced in order as those steps' outputs come.
"""
from __future__ import annotations

import enum
import time

from llmsvc import outputs
from llmsvc.sampling_params import SamplingParams
from llmsvc.wire import PLACEHOLDER_TOKEN_ID


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2  # back in the waiting queue after its blocks were freed (recompute)
    WAITING_FOR_FSM = 3  # structured output: admitted, its grammar still compiling (not queued yet)
    SWAPPED = 4  # preempted by swap: its KV blocks in the swap space, in the scheduler's swapped queue
    # finished states: everything after here
    FINISHED_STOPPED = 10
    FINISHED_LENGTH_CAPPED = 11
    FINISHED_CONTEXT = 12
    FINISHED_ABORTED = 13
    FINISHED_TIME_LIMIT = 14

    @staticmethod
    def is_finished(status: "RequestStatus") -> bool:
        return status >= RequestStatus.FINISHED_STOPPED

    @staticmethod
    def finish_reason(status: "RequestStatus") -> str | None:
        return _FINISH_REASONS.get(status)

    @staticmethod
    def from_finish_reason(reason: str) -> "RequestStatus":
        for status, r in _FINISH_REASONS.items():
            if r == reason:
                return status
        raise ValueError(f"unknown finish reason {reason!r}")


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: outputs.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: outputs.LENGTH,
    RequestStatus.FINISHED_CONTEXT: outputs.CONTEXT,
    RequestStatus.FINISHED_ABORTED: outputs.ABORT,
    RequestStatus.FINISHED_TIME_LIMIT: outputs.TIME_LIMIT,
}


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        *,
        eos_token_ids: list[int] | tuple[int, ...] = (),
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_key: str | None = None,
        lora_id: int = 0,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = frozenset(eos_token_ids)
        self.arrival_time = time.time() if arrival_time is None else arrival_time  # wall clock
        self.priority = priority  # lower value = scheduled sooner (priority policy)
        self.cache_salt = cache_salt or None  # prefix-cache group (KVCacheManager hashes it into block 0)
        self.lora_key = lora_key or None  # LoRA adapter's cache identity (hashed into block 0 too); None: base
        self.lora_id = lora_id  # the adapter's id: the workers' slot lora_id - 1; 0: the base model
        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        self._all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prompt tokens served by the prefix cache, set when first scheduled
        self.block_hashes: list[bytes] = []  # chained hash of each full block of all_token_ids
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0  # by recompute or by swap
        self.num_swaps = 0  # of those, preemptions by swap (its blocks copied out and back)
        # speculative decoding, over every step so far: draft tokens verified, and of those accepted
        # (Speculator.observe counts both, with the engine-wide counters)
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.first_scheduled_time: float | None = None
        # time_limit_ms is measured on the monotonic clock from admission
        limit = sampling_params.time_limit_ms
        self.deadline: float | None = None if limit is None else time.monotonic() + limit / 1000.0
        # set by the scheduler: the engine's max_model_len capped by what the KV pool can hold
        self.max_len: int | None = None
        # scheduler bookkeeping: output tokens the workers have already been sent
        self.num_output_tokens_sent = 0
        # prompt positions whose logprobs were reported (a preempted request recomputes them)
        self.num_prompt_logprobs_sent = 0
        # structured output: llmsvc.structured.StructuredRequest when the params carry a constraint
        self.structured = None
        # async scheduling: trailing output tokens that are placeholders for in-flight samples, and
        # samples still in flight from before a preemption (their tokens are dropped on arrival)
        self.num_output_placeholders = 0
        self.num_stale_samples = 0

    # ---- tokens ---------------------------------------------------------------------------
    @property
    def all_token_ids(self) -> list[int]:
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        self.output_token_ids.extend(token_ids)
        self._all_token_ids.extend(token_ids)

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose ids are known (placeholders excluded): what may be hashed or checked."""
        return len(self._all_token_ids) - self.num_output_placeholders

    def append_placeholder(self) -> None:
        self.append_output_token_ids(PLACEHOLDER_TOKEN_ID)
        self.num_output_placeholders += 1

    def resolve_placeholder(self, token_id: int) -> None:
        """Replace the oldest placeholder by the token its step sampled."""
        k = self.num_output_placeholders
        assert k > 0, self
        self.output_token_ids[-k] = token_id
        self._all_token_ids[-k] = token_id
        self.num_output_placeholders = k - 1

    def discard_placeholders(self) -> None:
        """Drop the unresolved placeholders (the request finished or was preempted first)."""
        k = self.num_output_placeholders
        if k:
            del self.output_token_ids[-k:]
            del self._all_token_ids[-k:]
            self.num_output_placeholders = 0
            self.num_output_tokens_sent = min(self.num_output_tokens_sent, self.num_output_tokens)

    # ---- status ---------------------------------------------------------------------------
    @property
    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finished_reason(self) -> str | None:
        return RequestStatus.finish_reason(self.status)

    @property
    def max_tokens(self) -> int | None:
        return self.sampling_params.max_tokens

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, prompt={self.num_prompt_tokens}, "
                f"output={self.num_output_tokens}, computed={self.num_computed_tokens})")
