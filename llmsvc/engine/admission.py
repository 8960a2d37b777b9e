"""Admission: the one place an EngineRequest is validated and completed (torch-free).

Every door builds an EngineRequest and hands it to `Admission.admit` exactly once (AsyncEngine
for the gRPC doors, LLMEngine.add_request for the offline LLM); nothing after it checks a field
again, except the scheduler's test that needs the KV pool. `admit` returns the request to queue:

- the rules of llmsvc.engine.validation against this engine's RequestLimits (ranges that need
  the model: vocab, n, logprobs, stop counts, room for output in max_len);
- cache_salt's shape; the LoRA adapter it names (LoRANotFoundError), resolved to its entry;
- structured output refused when this engine has no grammar engine;
- completions that make a request replayable: an unseeded sampling request gets a drawn seed
  (echoed back), bad_words are tokenized once;
- allowed_token_ids that the request's own bad_words / min_tokens leave nothing of (that needs
  the tokenized bad_words, so it is checked last).

The params are copied before they are completed, never changed in place (a caller may reuse
one SamplingParams for many requests), and copied without running their __post_init__ again:
SamplingParams.verify() ran once, when the door built them.
"""
from __future__ import annotations

import copy
import random
from dataclasses import dataclass

from llmsvc.core.errors import InvalidRequestError
from llmsvc.engine.bad_words import bad_words_token_ids
from llmsvc.engine.validation import RequestLimits, check_allowed_tokens_reachable, check_cache_salt, check_request
from llmsvc.engine_request import EngineRequest


@dataclass
class AdmittedRequest:
    """An EngineRequest that passed admission, with what admission resolved for the core."""

    request: EngineRequest
    lora_key: str | None = None  # the adapter's prefix-cache identity; None: the base model
    lora_id: int = 0  # LoRAConfig's 1-based adapter id; 0: the base model


class Admission:
    def __init__(self, limits: RequestLimits, *, tokenizer=None, loras=None, structured: bool = True,
                 seed: int | None = None) -> None:
        self.limits = limits
        self.tokenizer = tokenizer  # for bad_words; None: bad_words must come tokenized
        self.loras = loras  # llmsvc.engine.lora_registry.LoRARegistry, or None (no adapters)
        self.structured = structured  # whether this engine compiles structured-output constraints
        # seeds for unseeded sampling requests follow the configured seed, so a rerun of the same
        # requests repeats; 62 bits: seed + index of an n>1 request stays below the 2^63 allowed
        self._seed_rng = random.Random(seed)

    def admit(self, request: EngineRequest) -> AdmittedRequest:
        """Validate `request` (raises InvalidRequestError, PromptTooLongError, LoRANotFoundError)
        and return it completed, ready to queue."""
        params = request.sampling_params
        lora = self.loras.lookup(request.lora_name) if self.loras is not None else None
        if lora is None and request.lora_name is not None:
            raise InvalidRequestError("lora_name", "this engine serves no LoRA adapters")
        check_cache_salt(request.cache_salt)
        check_request(request.prompt_token_ids, params, self.limits)
        if params.structured_outputs is not None and not self.structured:
            raise InvalidRequestError("structured_outputs", "structured output needs the llguidance package "
                                      "and a fast (Rust) tokenizer; this engine has none")
        completed = None
        if params.seed is None and not params.greedy:
            completed = copy.copy(params)
            completed.seed = self._seed_rng.getrandbits(62)
        if params.bad_words and params.bad_words_token_ids is None:
            if self.tokenizer is None:
                raise InvalidRequestError("bad_words", "this engine has no tokenizer; send bad_words_token_ids")
            completed = completed or copy.copy(params)
            completed.bad_words_token_ids = bad_words_token_ids(self.tokenizer, params.bad_words)
        check_allowed_tokens_reachable(completed or params, self.limits)
        if completed is not None:
            request = copy.copy(request)
            request.sampling_params = completed
        return AdmittedRequest(request, lora.key if lora else None, lora.lora_id if lora else 0)
