"""EngineRequest: the one typed request every front door builds (torch-free, picklable).

A door (the llmsvc.v1 servicer, vLLM's engine protocol, the offline `LLM`) maps its own message
onto this type and hands it to the engine; from there it travels unchanged: AsyncEngine ->
engine thread -> LLMEngine -> (ZeroMQ) -> engine core -> scheduler. It is validated once, at
admission (`llmsvc.engine.admission`), against one set of limits; nothing downstream checks a
field again except what needs the KV pool (the scheduler's fit check).

Invariants once admitted:
- `prompt_token_ids` is non-empty and every id is < vocab_size;
- `sampling_params` has passed `verify()` and the engine's limits, and its `max_tokens` is the
  resolved one (generation_config's default filled in where it fits);
- `request_id` is free in the engine (no request, and no sample of an n>1 request, holds it).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from llmsvc.sampling_params import SamplingParams


@dataclass
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    prompt: str | None = None  # the prompt's text when the door had one (echoed in outputs)
    priority: int = 0  # lower is scheduled sooner (the priority policy); fcfs ignores it
    cache_salt: str | None = None  # prefix-cache group: requests share cached blocks only within one salt
    lora_name: str | None = None  # a served LoRA adapter; None: the base model
    arrival_time: float = field(default_factory=time.time)  # wall clock, seconds

    def __post_init__(self) -> None:
        self.prompt_token_ids = list(self.prompt_token_ids)
