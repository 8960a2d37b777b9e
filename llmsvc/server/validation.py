"""GenerateRequest (proto) -> SamplingParams, checked before the request is queued (docs/api.md,
"Validation", lists the rules).

Unset optional fields take the model's generation_config default, then the neutral value.
The rules themselves are the engine's (llmsvc.engine.validation); this module only maps proto
fields in and engine field names out. Nothing is clamped: each violation is a ServiceError
naming the proto field and the limit.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

from llmsvc.engine import validation as rules
from llmsvc.engine.chat_rules import CHAT_ROLES, MAX_TOOLS, RESERVED_TEMPLATE_KWARGS
from llmsvc.core.errors import InvalidRequestError
from llmsvc.sampling_params import GENERATION_DEFAULTS, PROTO_PARENTS, RequestOutputKind, SamplingParams
from llmsvc.server.constraints import served_constraints, structured_outputs_from_proto
from llmsvc.server.errors import clip, invalid, to_service_error

MAX_REQUEST_ID_CHARS = 256
MAX_LABELS = 64
MAX_LABEL_CHARS = 256  # a label's key or value: each goes into every log line of the request and a metric series
MAX_ABORT_REASON_CHARS = 256  # sent back in each aborted stream's FinishInfo.abort_reason


@dataclass
class ModelLimits:
    """What a door reads beyond the engine's RequestLimits, which it carries (never copies):
    the engine's limits are the ones admission checks, so the door's view cannot drift."""

    request_limits: rules.RequestLimits
    generation_defaults: dict = field(default_factory=dict)
    supported_constraints: tuple[str, ...] = ()

    @classmethod
    def from_config(cls, config, engine_limits: rules.RequestLimits | None = None) -> "ModelLimits":
        """engine_limits: the engine's own (LLMEngine.request_limits), whose length bound is below
        the model's context when the KV pool holds fewer tokens; None: the config's (the model's
        context, its vocabulary)."""
        mc = config.model_config
        if engine_limits is None:
            engine_limits = rules.RequestLimits(vocab_size=mc.vocab_size, max_len=mc.max_model_len, max_n=config.max_n,
                                                max_stop_strings=config.max_stop_strings,
                                                max_logprobs=config.max_logprobs)
        return cls(engine_limits, dict(mc.generation_defaults or {}), served_constraints())

    @property
    def vocab_size(self) -> int:
        return self.request_limits.vocab_size

    @property
    def max_model_len(self) -> int:
        """Tokens one request may hold: the model's context, or the KV pool's when smaller."""
        return self.request_limits.max_len

    def default_sampling(self) -> dict:
        """The values unset sampling fields resolve to (generation_config, then neutral)."""
        out = {}
        for name, neutral in GENERATION_DEFAULTS.items():
            v = self.generation_defaults.get(name)
            out[name] = type(neutral)(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else neutral
        if out["top_k"] < 0:
            out["top_k"] = 0
        return out


def check_request_id(rid: str) -> None:
    """The id goes back in the x-request-id response header: gRPC takes printable ASCII there."""
    if len(rid) > MAX_REQUEST_ID_CHARS:
        raise invalid("request_id", f"must be at most {MAX_REQUEST_ID_CHARS} characters, got {len(rid)}")
    if any(not " " <= c <= "~" for c in rid):
        raise invalid("request_id", "must contain printable ASCII characters only (it is echoed in the "
                                    "x-request-id response header)")


def check_abort_ids(ids, limit: int) -> None:
    if len(ids) > limit:
        raise invalid("request_ids", f"at most {limit} ids (the requests the server holds at most), got {len(ids)}")


def check_labels(labels) -> None:
    if len(labels) > MAX_LABELS:
        raise invalid("labels", f"at most {MAX_LABELS} labels, got {len(labels)}")
    for key, value in labels.items():
        if len(key) > MAX_LABEL_CHARS or len(value) > MAX_LABEL_CHARS:
            raise invalid("labels", f"label {clip(key, 35)!r}: keys and values must be at most {MAX_LABEL_CHARS} "
                                    f"characters, got {len(key)} and {len(value)}")


def check_abort_reason(reason: str) -> None:
    if len(reason) > MAX_ABORT_REASON_CHARS:
        raise invalid("reason", f"must be at most {MAX_ABORT_REASON_CHARS} characters, got {len(reason)}")
    if not reason.isprintable():
        raise invalid("reason", "must contain printable characters only")


def check_chat(chat, field_prefix: str = "chat") -> None:
    messages = chat.messages
    if not messages:
        raise invalid(f"{field_prefix}.messages", "must contain at least one message")
    for i, m in enumerate(messages):
        if m.role not in CHAT_ROLES:
            raise invalid(f"{field_prefix}.messages[{i}].role",
                          f"must be one of {', '.join(CHAT_ROLES)}, got {m.role!r}")
    if chat.continue_final_message and chat.HasField("add_generation_prompt") and chat.add_generation_prompt:
        raise invalid(f"{field_prefix}.continue_final_message",
                      "cannot be combined with add_generation_prompt=true (one opens a new turn, the other "
                      "continues the last)")
    if len(chat.tools) > MAX_TOOLS:
        raise invalid(f"{field_prefix}.tools", f"at most {MAX_TOOLS} tools, got {len(chat.tools)}")
    reserved = sorted(set(chat.chat_template_kwargs.fields) & RESERVED_TEMPLATE_KWARGS)
    if reserved:
        raise invalid(f"{field_prefix}.chat_template_kwargs",
                      f"{', '.join(reserved)} cannot be set here (use the request's own fields)")


def check_token_ids(name: str, ids, vocab_size: int) -> None:
    with engine_rules():
        rules.check_token_ids(name, ids, vocab_size)


@contextmanager
def engine_rules():
    """Run engine rules; their InvalidRequestError / PromptTooLongError become proto-named ServiceErrors."""
    try:
        yield
    except InvalidRequestError as e:
        raise to_service_error(e) from None


def build_sampling_params(req, limits: ModelLimits) -> SamplingParams:
    """The SamplingParams of `req`'s sampling/stopping/output fields, unverified: admission
    (llmsvc.engine.admission) checks them, once, with the prompt."""
    s, st, o = req.sampling, req.stopping, req.output
    if limits.vocab_size and len(s.allowed_token_ids) > limits.vocab_size:  # before copying millions of ids
        raise invalid("sampling.allowed_token_ids", f"at most vocab_size ({limits.vocab_size}) ids, "
                                                    f"got {len(s.allowed_token_ids)}")
    structured_outputs = structured_outputs_from_proto(s, limits.supported_constraints)
    defaults = limits.default_sampling()
    kw = {}
    for name in GENERATION_DEFAULTS:  # optional scalars: unset takes the model's default
        part = getattr(req, PROTO_PARENTS[name])
        kw[name] = getattr(part, name) if part.HasField(name) else defaults[name]
    with engine_rules():
        params = rules.make_sampling_params(
            n=s.n if s.HasField("n") else 1, seed=s.seed if s.HasField("seed") else None,
            logit_bias=dict(s.logit_bias) or None, allowed_token_ids=list(s.allowed_token_ids) or None,
            bad_words=list(s.bad_words) or None,
            stop=list(st.stop), stop_token_ids=list(st.stop_token_ids),
            include_stop_str_in_output=st.include_stop_str_in_output, ignore_eos=st.ignore_eos,
            max_tokens=st.max_tokens if st.HasField("max_tokens") else None, min_tokens=st.min_tokens,
            logprobs=o.logprobs if o.HasField("logprobs") else None,
            prompt_logprobs=o.prompt_logprobs if o.HasField("prompt_logprobs") else None,
            skip_special_tokens=o.skip_special_tokens if o.HasField("skip_special_tokens") else True,
            spaces_between_special_tokens=(o.spaces_between_special_tokens
                                           if o.HasField("spaces_between_special_tokens") else True),
            time_limit_ms=st.time_limit_ms or None,
            output_kind=RequestOutputKind.DELTA,
            stream_interval=o.stream_interval or None,  # unset or 0: the server's
            structured_outputs=structured_outputs,
            **kw)
    return params


def fill_default_max_tokens(params: SamplingParams, num_prompt_tokens: int, limits: ModelLimits) -> None:
    """An unset max_tokens takes generation_config's max_new_tokens (at least min_tokens) where
    the prompt leaves room for it, as vLLM caps it; else it stays unset (to max_model_len)."""
    if params.max_tokens is None:
        params.max_tokens = rules.default_max_tokens(limits.generation_defaults.get("max_tokens"),
                                                     num_prompt_tokens, params, limits.max_model_len)
