"""GenerateRequest (proto) -> SamplingParams, checking every rule of API.md "Validation".

Unset optional fields take the model's generation_config default, then the neutral value.
Nothing is clamped: each violation is a ServiceError naming the proto field and the limit.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from llmsvc.server.constraints import served_constraints, structured_outputs_from_proto
from llmsvc.server.errors import invalid, prompt_too_long
from llmsvc.sampling_params import RequestOutputKind, SamplingParams

# proto field -> (SamplingParams field, neutral value); generation_config uses the same names
SAMPLING_FIELDS = {
    "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
    "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
}
MAX_STOP_STRING_CHARS = 1024
MAX_REQUEST_ID_CHARS = 256
MAX_LABELS = 64
CONSTRAINTS = ("json_schema", "regex", "choice", "grammar", "json_object")
CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")


@dataclass
class ModelLimits:
    vocab_size: int
    max_model_len: int
    max_n: int = 16
    max_stop_strings: int = 64
    max_logprobs: int = 20
    generation_defaults: dict = field(default_factory=dict)
    supported_constraints: tuple[str, ...] = ()

    @classmethod
    def from_config(cls, config) -> "ModelLimits":
        mc = config.model_config
        return cls(vocab_size=mc.vocab_size, max_model_len=mc.max_model_len, max_n=config.max_n,
                   max_stop_strings=config.max_stop_strings,
                   generation_defaults=dict(mc.generation_defaults or {}),
                   supported_constraints=served_constraints())

    def default_sampling(self) -> dict:
        """The values unset sampling fields resolve to (generation_config, then neutral)."""
        out = {}
        for name, neutral in SAMPLING_FIELDS.items():
            v = self.generation_defaults.get(name)
            out[name] = type(neutral)(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else neutral
        if out["top_k"] < 0:
            out["top_k"] = 0
        return out


def _finite(name: str, v: float) -> float:
    if not math.isfinite(v):
        raise invalid(name, f"must be a finite number, got {v}")
    return v


def _in_range(name: str, v: float, lo: float, hi: float, lo_open: bool = False) -> None:
    _finite(name, v)
    if (v <= lo if lo_open else v < lo) or v > hi:
        left = "(" if lo_open else "["
        raise invalid(name, f"must be in {left}{lo:g}, {hi:g}], got {v:g}")


def check_request_id(rid: str) -> None:
    if len(rid) > MAX_REQUEST_ID_CHARS:
        raise invalid("request_id", f"must be at most {MAX_REQUEST_ID_CHARS} characters, got {len(rid)}")
    if any(not c.isprintable() for c in rid):
        raise invalid("request_id", "must contain printable characters only")


def check_labels(labels) -> None:
    if len(labels) > MAX_LABELS:
        raise invalid("labels", f"at most {MAX_LABELS} labels, got {len(labels)}")


def check_chat(messages, field_prefix: str = "chat") -> None:
    if not messages:
        raise invalid(f"{field_prefix}.messages", "must contain at least one message")
    for i, m in enumerate(messages):
        if m.role not in CHAT_ROLES:
            raise invalid(f"{field_prefix}.messages[{i}].role",
                          f"must be one of {', '.join(CHAT_ROLES)}, got {m.role!r}")


def check_token_ids(name: str, ids, vocab_size: int) -> None:
    for i, t in enumerate(ids):
        if t >= vocab_size:
            raise invalid(f"{name}[{i}]", f"token id {t} is out of range [0, {vocab_size})")


def build_sampling_params(req, limits: ModelLimits) -> SamplingParams:
    """Check the sampling/stopping/output fields of `req`; prompt-length checks come later."""
    s, st, o = req.sampling, req.stopping, req.output
    structured_outputs = structured_outputs_from_proto(s, limits.supported_constraints)
    defaults = limits.default_sampling()
    kw = {}
    for name in SAMPLING_FIELDS:
        kw[name] = getattr(s, name) if s.HasField(name) else defaults[name]
    _finite("sampling.temperature", kw["temperature"])
    if kw["temperature"] < 0:
        raise invalid("sampling.temperature", f"must be >= 0 (0 = greedy), got {kw['temperature']:g}")
    _in_range("sampling.top_p", kw["top_p"], 0.0, 1.0, lo_open=True)
    if kw["top_k"] < -1:
        raise invalid("sampling.top_k", f"must be >= 1, or 0 / -1 to disable, got {kw['top_k']}")
    if kw["top_k"] > limits.vocab_size:
        raise invalid("sampling.top_k", f"must be <= vocab_size ({limits.vocab_size}), got {kw['top_k']}")
    _in_range("sampling.min_p", kw["min_p"], 0.0, 1.0)
    _in_range("sampling.presence_penalty", kw["presence_penalty"], -2.0, 2.0)
    _in_range("sampling.frequency_penalty", kw["frequency_penalty"], -2.0, 2.0)
    _finite("sampling.repetition_penalty", kw["repetition_penalty"])
    if kw["repetition_penalty"] <= 0:
        raise invalid("sampling.repetition_penalty", f"must be > 0, got {kw['repetition_penalty']:g}")
    n = s.n if s.HasField("n") else 1
    if not 1 <= n <= limits.max_n:
        raise invalid("sampling.n", f"must be in [1, {limits.max_n}], got {n}")
    seed = s.seed if s.HasField("seed") else None
    if seed is not None and seed >= 2 ** 63:
        raise invalid("sampling.seed", f"must be < 2^63, got {seed}")
    logit_bias = {}
    for tok, b in s.logit_bias.items():
        if tok >= limits.vocab_size:
            raise invalid("sampling.logit_bias", f"token id {tok} is out of range [0, {limits.vocab_size})")
        _in_range(f"sampling.logit_bias[{tok}]", b, -100.0, 100.0)
        logit_bias[tok] = b

    max_tokens = st.max_tokens if st.HasField("max_tokens") else None
    if max_tokens is not None and max_tokens < 1:
        raise invalid("stopping.max_tokens", f"must be >= 1 (leave unset to fill the context), got {max_tokens}")
    if max_tokens is not None and max_tokens >= limits.max_model_len:
        raise invalid("stopping.max_tokens", f"must be < max_model_len ({limits.max_model_len}), got {max_tokens}")
    if max_tokens is not None and st.min_tokens > max_tokens:
        raise invalid("stopping.min_tokens", f"must be <= max_tokens ({max_tokens}), got {st.min_tokens}")
    if st.min_tokens >= limits.max_model_len:
        raise invalid("stopping.min_tokens", f"must be < max_model_len ({limits.max_model_len}), got {st.min_tokens}")
    if len(st.stop) > limits.max_stop_strings:
        raise invalid("stopping.stop", f"at most {limits.max_stop_strings} stop strings, got {len(st.stop)}")
    for i, stop in enumerate(st.stop):
        if not stop:
            raise invalid(f"stopping.stop[{i}]", "stop strings must not be empty")
        if len(stop) > MAX_STOP_STRING_CHARS:
            raise invalid(f"stopping.stop[{i}]", f"must be at most {MAX_STOP_STRING_CHARS} characters")
    if len(st.stop_token_ids) > limits.max_stop_strings:
        raise invalid("stopping.stop_token_ids",
                      f"at most {limits.max_stop_strings} stop token ids, got {len(st.stop_token_ids)}")
    check_token_ids("stopping.stop_token_ids", st.stop_token_ids, limits.vocab_size)

    for name in ("logprobs", "prompt_logprobs"):
        if o.HasField(name) and getattr(o, name) > limits.max_logprobs:
            raise invalid(f"output.{name}", f"must be in [0, {limits.max_logprobs}], got {getattr(o, name)}")
    try:
        return SamplingParams(
            n=n, seed=seed, logit_bias=logit_bias or None,
            stop=list(st.stop), stop_token_ids=list(st.stop_token_ids),
            include_stop_str_in_output=st.include_stop_str_in_output, ignore_eos=st.ignore_eos,
            max_tokens=max_tokens, min_tokens=st.min_tokens,
            logprobs=o.logprobs if o.HasField("logprobs") else None,
            prompt_logprobs=o.prompt_logprobs if o.HasField("prompt_logprobs") else None,
            skip_special_tokens=o.skip_special_tokens if o.HasField("skip_special_tokens") else True,
            spaces_between_special_tokens=(o.spaces_between_special_tokens
                                           if o.HasField("spaces_between_special_tokens") else True),
            time_limit_ms=st.time_limit_ms or None,
            output_kind=RequestOutputKind.DELTA,
            structured_outputs=structured_outputs,
            **kw)
    except ValueError as e:  # SamplingParams.verify(): "<field> <why>" (belt and braces)
        name, _, why = str(e).partition(" ")
        raise invalid(name, why) from None


def check_prompt_fits(params: SamplingParams, num_prompt_tokens: int, limits: ModelLimits) -> None:
    """Prompt (+ min_tokens, + explicit max_tokens) must fit in max_model_len."""
    L = limits.max_model_len
    if num_prompt_tokens + max(params.min_tokens, 1) > L:
        raise prompt_too_long(num_prompt_tokens, L,
                              f"prompt has {num_prompt_tokens} tokens (+ min_tokens {params.min_tokens}); "
                              f"max_model_len is {L}: shorten it or set truncate_prompt_tokens")
    if params.max_tokens is not None and num_prompt_tokens + params.max_tokens > L:
        raise invalid("stopping.max_tokens",
                      f"prompt ({num_prompt_tokens} tokens) + max_tokens ({params.max_tokens}) exceeds "
                      f"max_model_len ({L}); lower max_tokens to <= {L - num_prompt_tokens} or leave it unset",
                      prompt_tokens=num_prompt_tokens, max_model_len=L)
