"""vllm.grpc.engine.GenerateRequest -> EngineRequest, and engine errors -> the proto's field paths.

The mapper only translates: which proto field becomes which SamplingParams field, and what a
proto3 zero means where the proto cannot say "unset". The rules themselves run once, at
admission inside the engine (llmsvc.engine.admission), as for every other door; their errors
name SamplingParams fields, which `vllm_error` turns into this proto's paths
("sampling_params.top_p", "tokenized.input_ids[3]").

Zeros (proto3 scalars without presence):
- top_p 0 and repetition_penalty 0 are out of range, so they read as unset: the model's
  default (generation_config, then neutral), as an unset field of llmsvc.v1;
- every other zero is the value itself (top_k 0: disabled; min_p, penalties 0: off; n 0: 1);
- temperature, max_tokens, logprobs, prompt_logprobs, seed and truncate_prompt_tokens have
  presence: unset is the model's default / none / no truncation;
- sampling fields this proto does not have (typical_p) take the model's default.

Conversions: seed is an int32 here (a gateway clamps OpenAI's int64 into it), so a negative
seed is read as its unsigned 32-bit value (same seed, same tokens); truncate_prompt_tokens -1
keeps as many prompt tokens as leave room for one output token.

Fields with no equivalent in this engine are refused (INVALID_ARGUMENT naming the field),
never dropped: multimodal inputs and media references (text models only), KV-transfer
parameters (no prefill/decode disaggregation), and a data-parallel rank other than 0.

The `structural_tag` constraint, which llmsvc.v1 does not carry, becomes the structural_tag
kind of StructuredOutputsParams, as vLLM's own StructuredOutputsParams takes it.
"""
from __future__ import annotations

import grpc

from llmsvc.core.errors import InvalidRequestError, PromptTooLongError
from llmsvc.engine import validation as rules
from llmsvc.engine_request import EngineRequest
from llmsvc.sampling_params import RequestOutputKind, StructuredOutputsParams
from llmsvc.sampling_params_error import SamplingParamsError
from llmsvc.server.constraints import PROTO_FIELDS, check_size, structured_outputs_from_proto
from llmsvc.server.errors import ServiceError, invalid, prompt_too_long
from llmsvc.server.prompt import encode
from llmsvc.server.validation import ModelLimits, fill_default_max_tokens
from llmsvc.structured import errors as E
from llmsvc.structured.errors import ConstraintError

SP = "sampling_params"
# SamplingParams fields that this proto's SamplingParams spells the same way
SAME_NAMES = frozenset({
    "temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty",
    "max_tokens", "min_tokens", "stop", "stop_token_ids", "skip_special_tokens", "spaces_between_special_tokens",
    "ignore_eos", "n", "logprobs", "prompt_logprobs", "seed", "include_stop_str_in_output", "logit_bias"})
# StructuredOutputsParams kind -> this proto's constraint field: llmsvc.v1's, plus the structural
# tag, which only this proto carries (under the kind's own name)
CONSTRAINT_FIELDS = {**PROTO_FIELDS, "structural_tag": "structural_tag"}
_UNSUPPORTED_REQUEST_FIELDS = {
    "mm_inputs": "this server runs text-only models: send token ids or text without media",
    "media_refs": "this server runs text-only models: send token ids or text without media",
    "kv_transfer_params": "prefill/decode disaggregation (KV transfer) is not served here",
}


def input_field(req) -> str:
    """The proto path of the request's prompt, for errors about it."""
    return "tokenized.input_ids" if req.WhichOneof("input") == "tokenized" else "text"


def _refuse_unsupported(req) -> None:
    for name, why in _UNSUPPORTED_REQUEST_FIELDS.items():
        if req.HasField(name):
            raise invalid(name, why)
    if req.extra_mm_inputs:
        raise invalid("extra_mm_inputs", _UNSUPPORTED_REQUEST_FIELDS["mm_inputs"])
    if req.HasField("kv_transfer_params_json"):
        raise invalid("kv_transfer_params_json", _UNSUPPORTED_REQUEST_FIELDS["kv_transfer_params"])
    if req.HasField("data_parallel_rank") and req.data_parallel_rank != 0:
        raise invalid("data_parallel_rank", f"this server is one data-parallel rank (0), got {req.data_parallel_rank}")


def prompt_ids(req, tokenizer, limits: ModelLimits) -> list[int]:
    """The prompt's token ids (tokenized, or text encoded with special tokens), truncated if asked."""
    kind = req.WhichOneof("input")
    if kind is None:
        raise invalid("input", "set tokenized or text")
    if kind == "tokenized":
        ids = list(req.tokenized.input_ids)
    else:
        if not req.text:
            raise invalid("text", "prompt must not be empty")
        ids = encode(tokenizer, req.text, True)
    if not ids:
        raise invalid(input_field(req), "prompt must not be empty")
    sp = req.sampling_params
    if sp.HasField("truncate_prompt_tokens"):
        n = sp.truncate_prompt_tokens
        keep = limits.max_model_len - 1 if n == -1 else n
        if not 1 <= keep < limits.max_model_len:
            raise invalid(f"{SP}.truncate_prompt_tokens",
                          f"must be -1 or in [1, {limits.max_model_len - 1}], got {n}")
        ids = ids[-keep:]
    return ids


def _sampling_kwargs(sp, limits: ModelLimits) -> dict:
    defaults = limits.default_sampling()
    # fields this proto cannot carry (typical_p) take the model's default, as unset ones of llmsvc.v1
    absent = {k: v for k, v in defaults.items() if k not in sp.DESCRIPTOR.fields_by_name}
    return dict(
        **absent,
        temperature=sp.temperature if sp.HasField("temperature") else defaults["temperature"],
        top_p=sp.top_p or defaults["top_p"], top_k=sp.top_k, min_p=sp.min_p,
        frequency_penalty=sp.frequency_penalty, presence_penalty=sp.presence_penalty,
        repetition_penalty=sp.repetition_penalty or defaults["repetition_penalty"],
        max_tokens=sp.max_tokens if sp.HasField("max_tokens") else None, min_tokens=sp.min_tokens,
        stop=list(sp.stop), stop_token_ids=list(sp.stop_token_ids),
        skip_special_tokens=sp.skip_special_tokens, spaces_between_special_tokens=sp.spaces_between_special_tokens,
        ignore_eos=sp.ignore_eos, include_stop_str_in_output=sp.include_stop_str_in_output,
        n=sp.n or 1,
        logprobs=sp.logprobs if sp.HasField("logprobs") else None,
        prompt_logprobs=sp.prompt_logprobs if sp.HasField("prompt_logprobs") else None,
        seed=(sp.seed & 0xFFFFFFFF) if sp.HasField("seed") else None,
        logit_bias=dict(sp.logit_bias) or None,
        output_kind=RequestOutputKind.DELTA)


def to_engine_request(req, request_id: str, tokenizer, limits: ModelLimits) -> EngineRequest:
    """The EngineRequest of `req` (not yet validated: the engine admits it). Raises ServiceError
    (vLLM proto paths) for what cannot be translated."""
    _refuse_unsupported(req)
    sp = req.sampling_params
    structured = _structured_outputs(sp, limits)
    ids = prompt_ids(req, tokenizer, limits)
    try:
        params = rules.make_sampling_params(structured_outputs=structured, **_sampling_kwargs(sp, limits))
    except InvalidRequestError as e:
        raise vllm_error(e, input_field(req)) from None
    fill_default_max_tokens(params, len(ids), limits)
    return EngineRequest(request_id, ids, params, prompt=req.text if req.WhichOneof("input") == "text" else None)


def _structured_outputs(sp, limits: ModelLimits) -> StructuredOutputsParams | None:
    """The request's constraint, checked as far as it can be without compiling (as llmsvc.v1's)."""
    if sp.WhichOneof("constraint") != "structural_tag":
        try:
            return structured_outputs_from_proto(sp, limits.supported_constraints)
        except ServiceError as e:
            raise _repath_constraint(e) from None
    field = f"{SP}.structural_tag"
    if not limits.supported_constraints:  # no grammar engine in this build: as for every other kind
        raise ServiceError(grpc.StatusCode.UNIMPLEMENTED, f"{field}: structured output is not supported by this server")
    text = sp.structural_tag
    check_size(field, len(text))
    try:
        return StructuredOutputsParams(structural_tag=text)
    except SamplingParamsError as e:
        raise invalid(field, e.why, E.INVALID_JSON if "not valid JSON" in e.why else E.INVALID_GRAMMAR) from None


def _repath_constraint(e: ServiceError) -> ServiceError:
    """llmsvc.v1's constraint errors name "sampling.<kind>"; here the oneof lives in sampling_params.
    A kind this build does not compile is a field it cannot honour: INVALID_ARGUMENT."""
    field = e.field or (e.message.split(":", 1)[0] if e.message.startswith("sampling.") else None)
    if field is None or not field.startswith("sampling."):
        return e
    path = SP + field[len("sampling"):]
    why = e.message.split(": ", 1)[1] if ": " in e.message else e.message
    return invalid(path, why, e.reason or "INVALID_ARGUMENT")


def proto_path(engine_field: str, prompt_field: str) -> str:
    """A SamplingParams / EngineRequest field name (with an index, "stop[1]") as this proto's path."""
    base, bracket, rest = engine_field.partition("[")
    if base in SAME_NAMES:
        return f"{SP}.{engine_field}"
    if base in ("prompt_token_ids", "prompt"):
        return prompt_field + bracket + rest
    if base == "structured_outputs":
        return f"{SP}.constraint"
    return engine_field


def vllm_error(exc: BaseException, prompt_field: str) -> BaseException:
    """Engine validation errors as INVALID_ARGUMENT on this proto's field paths; anything else as is
    (llmsvc.server.errors maps it)."""
    if isinstance(exc, PromptTooLongError):
        return prompt_too_long(exc.prompt_tokens, exc.max_model_len, exc.message, field=prompt_field)
    if isinstance(exc, ConstraintError):
        return invalid(f"{SP}.{CONSTRAINT_FIELDS[exc.kind]}", exc.message, exc.reason)
    if isinstance(exc, InvalidRequestError):
        return invalid(proto_path(exc.field, prompt_field), exc.message)
    return exc
