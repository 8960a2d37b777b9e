"""What the engine hands to its front ends (offline LLM, gRPC server). Torch-free.

With RequestOutputKind.DELTA, `text`, `token_ids` and `logprobs` of a CompletionOutput
carry only what is new since the previous output for that index; otherwise everything
so far. Concatenating every delta's text gives exactly the final text.
"""
from __future__ import annotations

from dataclasses import dataclass, field

# finish reasons (strings, as vLLM)
STOP, LENGTH, CONTEXT, ABORT, TIME_LIMIT = "stop", "length", "context", "abort", "time_limit"


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None  # 1-based
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None  # one dict per token: sampled + top-k
    finish_reason: str | None = None  # None while running
    # what matched: int = stop token id, str = stop string, None otherwise (the tokenizer's EOS too, as vLLM)
    stop_reason: int | str | None = None
    num_output_tokens: int = 0  # cumulative, also in DELTA mode
    seed: int | None = None  # the seed this index sampled with (the request's seed + index)
    eos_token_id: int | None = None  # the EOS token that ended it (finish "stop"; stop_reason: see request_state)
    # speculative decoding for this index alone: draft tokens verified, and of those accepted
    # (RequestMetrics sums them over the indexes)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float  # time.time() when the engine accepted the request
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0  # summed over the n samples of the request
    num_swaps: int = 0  # of those, preemptions by swap (KV blocks copied out and back)
    # speculative decoding, summed over the n samples: draft tokens verified, and of those accepted
    # (0 and 0 with it off, or when no draft was proposed)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    metrics: RequestMetrics | None = None
    abort_reason: str = ""
    error: str | None = None  # set when the engine failed this request (server: INTERNAL/UNAVAILABLE)
    seed: int | None = None  # the request's seed (given, or picked at admission); index i uses seed + i


@dataclass
class SpecDecodeStats:
    """Speculative decoding counters since start-up: a draft is one request's draft tokens of one
    step; accepted_per_pos[i] counts the drafts whose token i was accepted."""
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verified draft, the one every step samples included (1 + accepted / drafts)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0


@dataclass
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    num_kv_blocks: int = 0
    num_free_kv_blocks: int = 0
    kv_cache_usage: float = 0.0  # 0..1
    prefix_cache_hit_rate: float = 0.0  # 0..1, over all prompt tokens looked up
    num_preemptions: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    extra: dict = field(default_factory=dict)
    spec_decode: SpecDecodeStats | None = None  # None: speculative decoding off
