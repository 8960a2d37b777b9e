"""SamplingParams: per-request sampling and stopping, named as in vLLM (torch-free).

Each client-settable field declares its facts on the field itself (`sampling_field`, see
llmsvc.sampling_fields): proto path, range, generation_config default, `llmsvc generate` flag.
Adding a sampling parameter is one declaration here, the proto field, and one sampler stage
(llmsvc/worker/stages/); docs/design.md walks through an example.

`verify()` raises SamplingParamsError (a ValueError) naming the field and the allowed range;
nothing is clamped silently. Built directly, params are verified at once (as vLLM's are); the
gRPC doors build them with `unverified()`, and admission (llmsvc.engine.admission) verifies
every request, so a served request is verified exactly once.
"""
from __future__ import annotations

import enum
import math
import numbers
import operator
from contextvars import ContextVar
from dataclasses import dataclass

from llmsvc.sampling_fields import declared
from llmsvc.sampling_fields import sampling_field as sf
from llmsvc.sampling_params_error import SamplingParamsError
from llmsvc.structured_params import StructuredOutputsParams

__all__ = ["RequestOutputKind", "SamplingParams", "SamplingParamsError", "StructuredOutputsParams"]

_SKIP_VERIFY: ContextVar[bool] = ContextVar("llmsvc_sampling_params_skip_verify", default=False)


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0  # every output carries everything so far
    DELTA = 1  # every output carries only what is new (streaming)
    FINAL_ONLY = 2  # one output, when the request finishes (offline generate)


@dataclass
class SamplingParams:
    n: int = sf(1, proto="sampling.n", kind="int", lo=1, cli="uint32", help="number of parallel samples")
    presence_penalty: float = sf(0.0, proto="sampling.presence_penalty", kind="float", lo=-2, hi=2,
                                 generation_config=True, cli="float", help="[-2, 2]")
    frequency_penalty: float = sf(0.0, proto="sampling.frequency_penalty", kind="float", lo=-2, hi=2,
                                  generation_config=True, cli="float", help="[-2, 2]")
    repetition_penalty: float = sf(1.0, proto="sampling.repetition_penalty", kind="float", lo=0, lo_open=True,
                                   generation_config=True, cli="float", help="> 0, 1 = off")
    temperature: float = sf(1.0, proto="sampling.temperature", kind="float", lo=0, generation_config=True,
                            cli="float", help="0 = greedy")
    top_p: float = sf(1.0, proto="sampling.top_p", kind="float", lo=0, hi=1, lo_open=True, generation_config=True,
                      cli="float", help="nucleus mass in (0, 1]")
    top_k: int = sf(0, proto="sampling.top_k", kind="int", lo=0, range_text="0 or -1 (disabled) or >= 1",
                    generation_config=True, cli="int32", help="keep the k most likely tokens (0/-1: off)")
    min_p: float = sf(0.0, proto="sampling.min_p", kind="float", lo=0, hi=1, generation_config=True, cli="float",
                      help="minimum probability relative to the top token")
    typical_p: float = sf(1.0, proto="sampling.typical_p", kind="float", lo=0, hi=1, lo_open=True,
                          generation_config=True, cli="float", help="locally typical mass in (0, 1]")
    seed: int | None = sf(None, proto="sampling.seed", kind="int", lo=0, cli="uint64", help="sampling seed")
    stop: list[str] = sf(default_factory=list, proto="stopping.stop", cli="str", repeated=True,
                         help="stop string (repeatable)")
    stop_token_ids: list[int] = sf(default_factory=list, proto="stopping.stop_token_ids", cli="uint32",
                                   flag="--stop-token-id", repeated=True, help="stop token id (repeatable)")
    include_stop_str_in_output: bool = sf(False, proto="stopping.include_stop_str_in_output", cli="bool",
                                          flag="--include-stop-str", help="keep the matched stop string in the output")
    ignore_eos: bool = sf(False, proto="stopping.ignore_eos", cli="bool", help="keep going past EOS")
    # None => up to max_model_len (finish reason "context")
    max_tokens: int | None = sf(16, proto="stopping.max_tokens", kind="int", lo=1, cli="uint32",
                                help="maximum generated tokens (default: fill the context)")
    min_tokens: int = sf(0, proto="stopping.min_tokens", kind="int", lo=0, cli="uint32",
                         help="minimum generated tokens before a stop may end the output")
    # None: none; 0: sampled token only; k: + top-k
    logprobs: int | None = sf(None, proto="output.logprobs", kind="int", lo=0, cli="uint32",
                              help="return logprobs of sampled tokens plus the top N")
    prompt_logprobs: int | None = sf(None, proto="output.prompt_logprobs", kind="int", lo=0)
    skip_special_tokens: bool = sf(True, proto="output.skip_special_tokens")
    spaces_between_special_tokens: bool = sf(True, proto="output.spaces_between_special_tokens")
    logit_bias: dict[int, float] | None = sf(None, proto="sampling.logit_bias")
    # only these may be sampled; None: every token
    allowed_token_ids: list[int] | None = sf(None, proto="sampling.allowed_token_ids", cli="uint32",
                                             flag="--allowed-token-id", repeated=True,
                                             help="sample only among these token ids (repeatable)")
    # never generated (see bad_words_token_ids)
    bad_words: list[str] | None = sf(None, proto="sampling.bad_words", cli="str", flag="--bad-word", repeated=True,
                                     help="a word never to generate (repeatable)")
    # the token sequences of bad_words (admission fills it from the engine's tokenizer, as
    # llmsvc.engine.bad_words does): the last token of each is masked where the output ends with
    # the rest
    bad_words_token_ids: list[list[int]] | None = None
    # graceful: finish "time_limit", output kept
    time_limit_ms: int | None = sf(None, proto="stopping.time_limit_ms", kind="int", lo=0, cli="uint32",
                                   help="graceful time limit (finish reason time_limit)")
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # tokens per streamed output; raised to the engine's
    stream_interval: int | None = sf(None, proto="output.stream_interval", kind="int", lo=1, cli="uint32",
                                     help="with --stream: new tokens per message (at least the server's "
                                          "--stream-interval)")
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

    def _normalize_numbers(self) -> None:
        """Integer fields hold ints and number fields floats (numpy and torch integers become
        ints; a float count, a string or a bool is refused, so that nothing fails later inside
        the sampler), read as vLLM reads them: logprobs=True is 1, seed=-1 is no seed, logit_bias
        keys may be JSON's strings."""
        for name in ("logprobs", "prompt_logprobs"):
            if isinstance(getattr(self, name), bool):
                setattr(self, name, int(getattr(self, name)))
        for f, facts in _NUMBERS:
            v = getattr(self, f.name)
            if facts.kind == "int":
                setattr(self, f.name, _integer(f.name, v))
            elif isinstance(v, bool) or not isinstance(v, numbers.Real):
                raise SamplingParamsError(f.name, f"must be a number, got {v!r}")
            else:
                setattr(self, f.name, float(v))
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
        """Ranges (each number field's declared one); logprobs and prompt_logprobs up to
        max_logprobs (the engine's; None: any)."""
        for f, facts in _NUMBERS:
            why = facts.violation(getattr(self, f.name))
            if why:
                raise SamplingParamsError(f.name, why)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise SamplingParamsError("min_tokens", f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and max_logprobs is not None and v > max_logprobs:
                raise SamplingParamsError(name, f"must be in [0, {max_logprobs}], got {v}")
        self._verify_lists()

    def _verify_lists(self) -> None:
        def bad(name: str, why: str) -> None:
            raise SamplingParamsError(name, why)

        for i, s in enumerate(self.stop):
            if not s:
                bad(f"stop[{i}]", "stop strings must not be empty")
        if any(t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be non-negative")
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
        for tok, b in (self.logit_bias or {}).items():
            if tok < 0:
                bad("logit_bias", f"token id must be >= 0, got {tok}")
            if not math.isfinite(b) or not -100.0 <= b <= 100.0:
                bad(f"logit_bias[{tok}]", f"must be in [-100, 100], got {b}")


# the number fields, in declaration order: normalized and range-checked from their Facts
_NUMBERS = tuple((f, facts) for f, facts in declared(SamplingParams) if facts.kind)


def _integer(name: str, v):
    """v as an int (None stays None); SamplingParamsError naming the field for anything else."""
    if v is None:
        return None
    if isinstance(v, bool):
        raise SamplingParamsError(name, f"must be an integer, got {v!r}")
    try:
        return operator.index(v)
    except TypeError:
        raise SamplingParamsError(name, f"must be an integer, got {v!r}") from None


# name -> neutral value of the fields whose unset value generation_config.json may give (the
# llmsvc.v1 door, GetModelInfo.default_sampling, checkpoint loading and LLM read this)
GENERATION_DEFAULTS = {f.name: f.default for f, facts in declared(SamplingParams) if facts.generation_config}
# name -> the llmsvc.v1 GenerateRequest message that holds it ("sampling", "stopping", "output")
PROTO_PARENTS = {f.name: facts.proto_parent for f, facts in declared(SamplingParams) if facts.proto_parent}
