"""Data that crosses the engine/executor boundary, once per step (torch-free, picklable).

`SchedulerOutput` is a diff, not a snapshot: a request is sent in full once
(`NewRequestData`, also when it resumes after preemption), afterwards only what changed
(`CachedRequestData`). Workers keep a per-request state keyed by `req_id` and drop it
when the id shows up in `finished_req_ids` (finished, aborted or preempted).

Worker-side invariant, per scheduled request r after applying the diff:
    tokens(r) = prompt_token_ids + output_token_ids (+ new_token_ids appended each step)
    the step computes tokens(r)[num_computed_tokens : num_computed_tokens + num_scheduled_tokens[r]]
    r samples a token this step iff num_computed_tokens + num_scheduled_tokens[r] == len(tokens(r))

Async scheduling: step N+1 is scheduled before step N's tokens are known, so a token r samples in
step N reaches the worker in step N+1's new_token_ids as PLACEHOLDER_TOKEN_ID. A placeholder only
ever stands for the token the worker itself sampled for r in the step just before (it executes
steps in order); the worker substitutes it before building the step's inputs.

Speculative decoding: a request with draft tokens in scheduled_spec_decode_tokens computes
tokens(r)[num_computed_tokens] followed by its drafts (num_scheduled_tokens[r] = 1 + drafts), and
samples at every one of those positions; the worker returns the drafts it accepted plus one more
token (1 to 1 + drafts tokens). The drafts never enter tokens(r): accepted ones come back in the
next step's new_token_ids like any sampled token, and num_computed_tokens is rolled back past the
rejected ones by the scheduler.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from llmsvc.sampling_params import SamplingParams

PLACEHOLDER_TOKEN_ID = -1  # "the token you sampled for this request last step" (async scheduling)


@dataclass
class NewRequestData:
    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # non-empty only when resuming after preemption
    sampling_params: SamplingParams
    block_ids: list[int]  # the request's whole block table so far
    num_computed_tokens: int  # prefix-cache hits (and nothing else) are already computed
    lora_id: int = 0  # LoRAConfig's 1-based adapter id; 0: the base model

    @classmethod
    def from_request(cls, request, block_ids: list[int]) -> "NewRequestData":
        return cls(
            req_id=request.request_id,
            prompt_token_ids=list(request.prompt_token_ids),
            output_token_ids=list(request.output_token_ids),
            sampling_params=request.sampling_params,
            block_ids=list(block_ids),
            num_computed_tokens=request.num_computed_tokens,
            lora_id=request.lora_id,
        )


@dataclass
class CachedRequestData:
    """Parallel lists, one entry per already-known request scheduled this step."""

    req_ids: list[str] = field(default_factory=list)
    # sampled since the worker last saw it; the last one may be PLACEHOLDER_TOKEN_ID
    new_token_ids: list[list[int]] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)  # appended to its block table
    num_computed_tokens: list[int] = field(default_factory=list)

    @classmethod
    def make_empty(cls) -> "CachedRequestData":
        return cls()


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]  # req_id -> tokens computed this step
    total_num_scheduled_tokens: int
    finished_req_ids: set[str]  # workers drop these states (finished, aborted, preempted)
    # structured output: the requests that sample this step under a grammar, and row i of
    # grammar_bitmask ([len(ids), ceil(n_vocab / 32)] int32 numpy, bit t % 32 of word t // 32
    # set iff token t is allowed) is the mask of structured_output_req_ids[i]
    structured_output_req_ids: list[str] = field(default_factory=list)
    grammar_bitmask: Any = None
    # speculative decoding: req_id -> draft tokens verified this step (only requests that have any)
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # swap space (llmsvc/core/swap_space.py): block copies the worker runs before the forward
    # pass, in this order: device -> host, host -> device, device -> device; (src, dst) pairs
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)

    @classmethod
    def make_empty(cls) -> "SchedulerOutput":
        return cls([], CachedRequestData.make_empty(), {}, 0, set())


@dataclass
class SampleLogprobs:
    """Logprobs of one sampled token. `top_*` are sorted by logprob, descending."""

    logprob: float
    rank: int  # 1-based rank of the sampled token in the distribution the logprobs come from (raw by default)
    top_token_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)


@dataclass
class ModelRunnerOutput:
    req_ids: list[str]  # requests that sampled this step, in batch order
    # per req_id, the tokens it produced: one, or with draft tokens the accepted drafts plus one
    sampled_token_ids: list[list[int]]
    # per req_id one entry per token of sampled_token_ids (None where the request asked for none)
    logprobs: list[list[SampleLogprobs] | None] | None = None
    # prompt logprobs for prompt positions computed this step: req_id -> one entry per
    # position (None for the first prompt token), when SamplingParams.prompt_logprobs is set
    prompt_logprobs: dict[str, list[SampleLogprobs | None]] = field(default_factory=dict)
    # req_id -> index into its sampled_token_ids of the first token whose row had nothing left
    # to sample (the grammar mask and the request's token rules forbade every token): that token
    # and the rest are not emitted, and the request ends "abort"
    no_token: dict[str, int] = field(default_factory=dict)

    @classmethod
    def make_empty(cls) -> "ModelRunnerOutput":
        return cls([], [])
