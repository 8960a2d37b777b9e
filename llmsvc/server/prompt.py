"""Prompt input (text | token ids | chat) -> (prompt text, prompt token ids), with truncation."""
from __future__ import annotations

import json

import grpc
from google.protobuf import json_format

from llmsvc.engine.chat_roles import developer_as_system
from llmsvc.server.errors import ServiceError, invalid
from llmsvc.server.validation import ModelLimits, check_chat


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def render_chat(tokenizer, chat, field_prefix: str = "chat") -> str:
    """Apply the model's chat template; FAILED_PRECONDITION if it has none."""
    check_chat(chat, field_prefix)
    if not has_chat_template(tokenizer):
        raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION,
                           "this model has no chat template: send `text` or `token_ids` instead, "
                           "or start the server with --chat-template",
                           reason="NO_CHAT_TEMPLATE")
    messages = [_message(m, f"{field_prefix}.messages[{i}]") for i, m in enumerate(chat.messages)]
    messages = developer_as_system(messages, tokenizer.chat_template)
    cont = chat.continue_final_message
    add_gen = chat.add_generation_prompt if chat.HasField("add_generation_prompt") else not cont
    kwargs = _struct(chat.chat_template_kwargs) if chat.HasField("chat_template_kwargs") else {}
    if chat.tools:
        kwargs["tools"] = [_struct(t) for t in chat.tools]
    if cont:
        kwargs["continue_final_message"] = True
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=add_gen, tokenize=False, **kwargs)
    except Exception as e:  # jinja raise_exception(...) in templates: bad role order etc.
        raise invalid(f"{field_prefix}.messages", f"the chat template rejected the messages: {e}") from None


def _struct(s) -> dict:
    """A Struct as a dict with every object's keys sorted: a Struct keeps no key order (nor
    a stable one between parses), and the same request must render the same prompt. A Struct
    holds every number as a double: whole ones come back as ints, as the JSON a client wrote
    ({"maximum": 10} renders "10", not "10.0", and `range(n)` in a template works)."""
    def ordered(v):
        if isinstance(v, dict):
            return {k: ordered(v[k]) for k in sorted(v)}
        if isinstance(v, list):
            return [ordered(x) for x in v]
        if isinstance(v, float) and v.is_integer() and abs(v) < 2 ** 53:
            return int(v)
        return v
    return ordered(json_format.MessageToDict(s))


def _message(m, field: str) -> dict:
    """A ChatMessage as the dict chat templates read (OpenAI's shape; tool-call arguments parsed
    to an object, as templates that write them with `tojson` expect)."""
    out = {"role": m.role, "content": m.content}
    if m.HasField("name"):
        out["name"] = m.name
    if m.HasField("tool_call_id"):
        out["tool_call_id"] = m.tool_call_id
    if m.tool_calls:
        calls = []
        for j, c in enumerate(m.tool_calls):
            try:
                args = json.loads(c.arguments) if c.arguments else {}
            except ValueError as e:
                raise invalid(f"{field}.tool_calls[{j}].arguments", f"not JSON: {e}") from None
            if not isinstance(args, dict):
                raise invalid(f"{field}.tool_calls[{j}].arguments", "must be a JSON object")
            calls.append({"id": c.id, "type": "function", "function": {"name": c.name, "arguments": args}})
        out["tool_calls"] = calls
    return out


def encode(tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])


def resolve_prompt(req, tokenizer, limits: ModelLimits) -> tuple[str | None, list[int]]:
    """The prompt of a GenerateRequest as (text or None, token ids), truncated if asked."""
    kind = req.WhichOneof("prompt")
    if kind is None:
        raise invalid("prompt", "set one of text, token_ids or chat")
    if kind == "token_ids":
        text, ids = None, list(req.token_ids.ids)
        if not ids:
            raise invalid("token_ids.ids", "prompt must not be empty")
    elif kind == "text":
        text = req.text
        if not text:
            raise invalid("text", "prompt must not be empty")
        add_special = req.add_special_tokens if req.HasField("add_special_tokens") else True
        ids = encode(tokenizer, text, add_special)
    else:
        text = render_chat(tokenizer, req.chat)
        add_special = req.add_special_tokens if req.HasField("add_special_tokens") else False
        ids = encode(tokenizer, text, add_special)
    if not ids:
        raise invalid(kind, "prompt encodes to zero tokens")
    if req.HasField("truncate_prompt_tokens"):
        n = req.truncate_prompt_tokens
        if not 1 <= n < limits.max_model_len:
            raise invalid("truncate_prompt_tokens", f"must be in [1, {limits.max_model_len - 1}], got {n}")
        if len(ids) > n:
            ids, text = ids[-n:], None
    return text, ids
