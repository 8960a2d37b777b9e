"""Speculative decoding's configuration (torch-free, picklable): EngineConfig.speculative_config."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

SPEC_METHODS = ("ngram",)


@dataclass
class SpeculativeConfig:
    """Speculative decoding by prompt lookup (vLLM's "ngram" method): a decoding request's last n
    tokens (prompt_lookup_max >= n >= prompt_lookup_min, longest first) are looked up earlier in
    its own tokens, and the up to num_speculative_tokens tokens that followed that occurrence are
    verified in the same step as the request's next token. Accepted drafts are exactly the tokens
    decoding one at a time would have produced (docs/spec-decode.md)."""
    method: str = "ngram"
    num_speculative_tokens: int = 0
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    # no drafts in a step while more than this many requests run (None: always draft)
    disable_by_batch_size: int | None = None
    # draft at a batch size only while steps with drafts emit more tokens per second than steps
    # without, as measured while serving (llmsvc/core/draft_governor.py); not a vLLM key
    adaptive: bool = True

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(SPEC_METHODS)}, got {self.method!r}")
        if not isinstance(self.num_speculative_tokens, int) or self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be an integer >= 1, got {self.num_speculative_tokens!r}")
        # unset: as vLLM, both 5; one set: the other equals it
        if self.prompt_lookup_max is None and self.prompt_lookup_min is None:
            self.prompt_lookup_max = self.prompt_lookup_min = 5
        elif self.prompt_lookup_max is None:
            self.prompt_lookup_max = self.prompt_lookup_min
        elif self.prompt_lookup_min is None:
            self.prompt_lookup_min = self.prompt_lookup_max
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError(f"disable_by_batch_size must be >= 1, got {self.disable_by_batch_size}")

    @classmethod
    def from_dict(cls, value: "dict | str | SpeculativeConfig") -> "SpeculativeConfig":
        """From vLLM's --speculative-config form: a dict or its JSON text. ValueError if bad."""
        if isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            import json
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative config must be a JSON object, got {value!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown speculative config key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**value)
