"""SamplingParams: per-request sampling and stopping, named as in vLLM (torch-free).

`verify()` raises SamplingParamsError (a ValueError) naming the field and the allowed range;
the server maps that to INVALID_ARGUMENT. Nothing is clamped silently. It runs when the params
are built, and again at admission (llmsvc.engine.admission) for params built with
`unverified()`, which the gRPC doors use so that a request is verified once.
"""
from __future__ import annotations

import enum
import json
import math
import numbers
import operator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

_SKIP_VERIFY: ContextVar[bool] = ContextVar("llmsvc_sampling_params_skip_verify", default=False)


class SamplingParamsError(ValueError):
    """A field out of range: `field` names it ("stop[1]", "logit_bias[7]"), `why` says what is allowed."""

    def __init__(self, field: str, why: str) -> None:
        super().__init__(f"{field} {why}")
        self.field = field
        self.why = why


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0  # every output carries everything so far
    DELTA = 1  # every output carries only what is new (streaming)
    FINAL_ONLY = 2  # one output, when the request finishes (offline generate)


@dataclass
class StructuredOutputsParams:
    """Structured output: exactly one constraint, named as vLLM names them.

    json: a JSON Schema (dict, or its JSON text); regex: the whole output must match;
    choice: the output is exactly one of these strings; grammar: Lark or GBNF (EBNF) text;
    json_object: any JSON object. `verify()` checks only what needs no compiling (the
    grammar engine reports the rest when the constraint is compiled).
    """

    json: str | dict | bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    KINDS = ("json", "regex", "choice", "grammar", "json_object")

    def __post_init__(self) -> None:
        if isinstance(self.choice, tuple):
            self.choice = list(self.choice)
        self.verify()

    @property
    def kind(self) -> str:
        return next(k for k in self.KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple[str, str]:
        """(kind, canonical text): the cache key of the compiled grammar."""
        kind, value = self.kind, getattr(self, self.kind)
        if kind == "json":
            # property order is kept: the grammar writes properties in the schema's order
            text = value if isinstance(value, str) else json.dumps(value)
        elif kind == "choice":
            text = json.dumps(value)
        elif kind == "json_object":
            text = ""
        else:
            text = value
        return kind, text

    def verify(self) -> None:
        set_ = [k for k in self.KINDS if getattr(self, k) not in (None, False)]
        if len(set_) != 1:
            raise SamplingParamsError("structured_outputs", f"must set exactly one of {', '.join(self.KINDS)}; "
                                      f"got {', '.join(set_) or 'none'}")
        kind = set_[0]
        value: Any = getattr(self, kind)
        if kind == "json":
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except json.JSONDecodeError as e:
                    raise SamplingParamsError("structured_outputs.json", f"is not valid JSON: {e}") from None
            if not isinstance(value, (dict, bool)):
                raise SamplingParamsError("structured_outputs.json", "must be a JSON Schema: an object or a "
                                          f"boolean, got {type(value).__name__}")
        elif kind == "choice":
            if not self.choice:
                raise SamplingParamsError("structured_outputs.choice", "must list at least one string")
            if not all(isinstance(c, str) and c for c in self.choice):
                raise SamplingParamsError("structured_outputs.choice", "entries must be non-empty strings")
        elif kind in ("regex", "grammar") and not isinstance(value, str):
            raise SamplingParamsError(f"structured_outputs.{kind}", "must be a string")
        elif kind == "json_object" and value is not True:
            raise SamplingParamsError("structured_outputs.json_object", "must be True when set")


@dataclass
class SamplingParams:
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0  # 0 => greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 => disabled
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None => up to max_model_len (finish reason "context")
    min_tokens: int = 0
    logprobs: int | None = None  # None: none; 0: sampled token only; k: + top-k
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None  # only these may be sampled; None: every token
    bad_words: list[str] | None = None  # never generated (see bad_words_token_ids)
    # the token sequences of bad_words (the engine fills it at admission from its tokenizer, as
    # llmsvc.engine.bad_words does): the last token of each is masked where the output ends with
    # the rest
    bad_words_token_ids: list[list[int]] | None = None
    time_limit_ms: int | None = None  # graceful: finish "time_limit", output kept
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    stream_interval: int | None = None  # tokens per streamed output; raised to the engine's
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.allowed_token_ids is not None:  # a set: the sampler expands it on every step
            self.allowed_token_ids = list(dict.fromkeys(self.allowed_token_ids))
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        if self.bad_words is not None:
            self.bad_words = list(self.bad_words)
        self._normalize_numbers()
        if self.top_k == -1:
            self.top_k = 0
        if not _SKIP_VERIFY.get():
            self.verify()

    @classmethod
    def unverified(cls, **kw) -> "SamplingParams":
        """Built and normalized but not verified: for a door whose request goes to admission
        next, which verifies it, so that verify() runs once per request."""
        token = _SKIP_VERIFY.set(True)
        try:
            return cls(**kw)
        finally:
            _SKIP_VERIFY.reset(token)

    _INTS = ("n", "top_k", "seed", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs", "time_limit_ms",
             "stream_interval")
    _FLOATS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p", "min_p")

    def _normalize_numbers(self) -> None:
        """Integer fields hold ints and number fields floats (numpy and torch integers become
        ints; a float count, a string or a bool is refused, so that nothing fails later inside
        the sampler), read as vLLM reads them: logprobs=True is 1, seed=-1 is no seed, logit_bias
        keys may be JSON's strings."""
        for name in ("logprobs", "prompt_logprobs"):
            if isinstance(getattr(self, name), bool):
                setattr(self, name, int(getattr(self, name)))
        for name in self._INTS:
            setattr(self, name, _integer(name, getattr(self, name)))
        for name in self._FLOATS:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Real):
                raise SamplingParamsError(name, f"must be a number, got {v!r}")
            setattr(self, name, float(v))
        if self.seed == -1:
            self.seed = None
        self.stop_token_ids = [_integer("stop_token_ids", t) for t in self.stop_token_ids]
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = [_integer("allowed_token_ids", t) for t in self.allowed_token_ids]
        if self.logit_bias is not None:  # keys may be JSON's strings ("5")
            self.logit_bias = {_integer("logit_bias", int(k) if isinstance(k, str) and k.isdigit() else k): v
                               for k, v in self.logit_bias.items()}

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def verify(self, max_logprobs: int | None = None) -> None:
        """Ranges; logprobs and prompt_logprobs up to max_logprobs (the engine's; None: any)."""
        def bad(name: str, why: str) -> None:
            raise SamplingParamsError(name, why)

        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty",
                     "temperature", "top_p", "min_p"):
            if not math.isfinite(getattr(self, name)):
                bad(name, f"must be a finite number, got {getattr(self, name)}")
        if self.n < 1:
            bad("n", f"must be >= 1, got {self.n}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}")
        if self.repetition_penalty <= 0.0:
            bad("repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        if self.temperature < 0.0:
            bad("temperature", f"must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            bad("top_k", f"must be 0 or -1 (disabled) or >= 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and self.max_tokens < 1:
            bad("max_tokens", f"must be >= 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            bad("min_tokens", f"must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        for i, s in enumerate(self.stop):
            if not s:
                bad(f"stop[{i}]", "stop strings must not be empty")
        if any(t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be non-negative")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and v < 0:
                bad(name, f"must be >= 0, got {v}")
            if v is not None and max_logprobs is not None and v > max_logprobs:
                bad(name, f"must be in [0, {max_logprobs}], got {v}")
        if self.seed is not None and self.seed < 0:
            bad("seed", f"must be >= 0, got {self.seed}")
        if self.stream_interval is not None and self.stream_interval < 1:
            bad("stream_interval", f"must be >= 1, got {self.stream_interval}")
        if self.time_limit_ms is not None and self.time_limit_ms < 0:
            bad("time_limit_ms", f"must be >= 0, got {self.time_limit_ms}")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                bad("allowed_token_ids", "must not be empty when set")
            if any(t < 0 for t in self.allowed_token_ids):
                bad("allowed_token_ids", "token ids must be >= 0")
        for i, w in enumerate(self.bad_words or ()):
            if not isinstance(w, str) or not w.strip():
                bad(f"bad_words[{i}]", "must be a non-blank string")
        for seq in self.bad_words_token_ids or ():
            if not seq or any(t < 0 for t in seq):
                bad("bad_words_token_ids", "each sequence must be non-empty token ids >= 0")
        if self.logit_bias:
            for tok, b in self.logit_bias.items():
                if tok < 0:
                    bad("logit_bias", f"token id must be >= 0, got {tok}")
                if not math.isfinite(b) or not -100.0 <= b <= 100.0:
                    bad(f"logit_bias[{tok}]", f"must be in [-100, 100], got {b}")


def _integer(name: str, v):
    """v as an int (None stays None); ValueError naming the field for anything else."""
    if v is None:
        return None
    if isinstance(v, bool):
        raise SamplingParamsError(name, f"must be an integer, got {v!r}")
    try:
        return operator.index(v)
    except TypeError:
        raise SamplingParamsError(name, f"must be an integer, got {v!r}") from None
