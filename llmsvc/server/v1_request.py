"""llmsvc.v1 GenerateRequest -> EngineRequest: this door's one mapper.

It only translates: proto fields into SamplingParams (unset optional fields take the model's
generation_config defaults), the prompt into token ids (text, chat or ids; truncated if asked),
an unset max_tokens into generation_config's default where it fits. Every rule on the result is
checked once, by admission in the engine (llmsvc.engine.admission); its errors name engine
fields, which `llmsvc.server.errors.proto_field` maps back onto this proto's paths.
"""
from __future__ import annotations

from llmsvc.engine_request import EngineRequest
from llmsvc.server.prompt import resolve_prompt
from llmsvc.server.validation import ModelLimits, build_sampling_params, fill_default_max_tokens


def to_engine_request(request, request_id: str, tokenizer, limits: ModelLimits) -> EngineRequest:
    """The EngineRequest of a llmsvc.v1 GenerateRequest (ServiceError for what only this door
    knows: no prompt set, a chat without a template, a constraint kind not served)."""
    params = build_sampling_params(request, limits)
    prompt, ids = resolve_prompt(request, tokenizer, limits)
    fill_default_max_tokens(params, len(ids), limits)
    return EngineRequest(request_id, ids, params, prompt=prompt, priority=request.priority,
                         cache_salt=request.cache_salt if request.HasField("cache_salt") else None,
                         lora_name=request.lora_name if request.HasField("lora_name") else None)
