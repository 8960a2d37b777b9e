"""Build llmsvc.v1 request messages from Python keyword arguments named after proto fields.

`build_generate_request(prompt, **fields)` routes each keyword to the message that owns the
field of that name: SamplingParams, StoppingCriteria, OutputOptions, ChatPrompt
(add_generation_prompt) or GenerateRequest itself. Unknown names raise TypeError, so a typo
never silently falls back to a server default. Unset keywords stay unset on the wire (every
tunable is `optional`), so the server's defaults apply.
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from llmsvc.chat_content import joined_text
from llmsvc.v1 import llmsvc_pb2 as pb

ChatMessages = Sequence[Mapping[str, str] | pb.ChatMessage | tuple[str, str]]

# OutputOptions.text / .token_ids collide with the GenerateRequest prompt oneof; pass them as
# output={"text": False, "token_ids": True} instead.
_OUTPUT_ONLY_VIA_DICT = {"text", "token_ids"}
_TOP_LEVEL = {"add_special_tokens", "priority", "truncate_prompt_tokens", "labels", "cache_salt", "lora_name"}
_CONSTRAINTS = {"json_schema", "regex", "choice", "grammar", "json_object"}


def _field_names(message_cls) -> set[str]:
    return {f.name for f in message_cls.DESCRIPTOR.fields}


_SAMPLING = _field_names(pb.SamplingParams)
_STOPPING = _field_names(pb.StoppingCriteria)
_OUTPUT = _field_names(pb.OutputOptions) - _OUTPUT_ONLY_VIA_DICT

_CHAT = {"add_generation_prompt", "continue_final_message", "tools", "chat_template_kwargs"}
GENERATE_KWARGS = frozenset(_SAMPLING | _STOPPING | _OUTPUT | _TOP_LEVEL | _CHAT)


def _fill(msg, values: Mapping[str, Any]) -> None:
    """Set fields of `msg` from a mapping; a repeated or map field given here replaces what the
    message held (a keyword overrides the section given whole)."""
    for name, value in values.items():
        if value is None:
            continue
        field = msg.DESCRIPTOR.fields_by_name.get(name)
        if field is None:
            raise TypeError(f"{msg.DESCRIPTOR.name} has no field {name!r}")
        if name in _CONSTRAINTS and msg.DESCRIPTOR.name == "SamplingParams":
            _set_constraint(msg, name, value)
        elif field.message_type is not None and not field.message_type.GetOptions().map_entry:
            sub = getattr(msg, name)
            if isinstance(value, Mapping):
                _fill(sub, value)
            else:
                sub.CopyFrom(value)
        else:
            try:
                _set_value(msg, field, name, value)
            except (TypeError, ValueError) as err:  # protobuf's words name neither field nor value
                raise type(err)(f"{name}={value!r}: {err}") from None


def _set_value(msg, field, name: str, value: Any) -> None:
    """A scalar, repeated or map field, replacing what it held."""
    if field.message_type is not None:  # a map
        getattr(msg, name).clear()
        getattr(msg, name).update(value)
    elif field.is_repeated:
        if isinstance(value, (str, bytes)):  # stop="###" means stop=["###"]
            value = [value]
        del getattr(msg, name)[:]
        getattr(msg, name).extend(value)
    else:
        setattr(msg, name, value)


def _set_constraint(sampling: pb.SamplingParams, name: str, value: Any) -> None:
    """Set one constraint of the oneof; TypeError when another one is set already (the proto
    would drop it silently)."""
    if name == "json_object" and value is False:
        return  # off, as a Python caller means it (the wire's json_object=false is refused)
    held = sampling.WhichOneof("constraint")
    if held is not None and held != name:
        raise TypeError(f"give at most one output constraint, got {held} and {name}")
    if name == "json_schema" and not isinstance(value, str):
        value = json.dumps(value)
    if name == "choice":
        if isinstance(value, pb.Choices):
            sampling.choice.CopyFrom(value)
        elif isinstance(value, Mapping):  # the proto's shape: {"choices": [...]}
            sampling.choice.Clear()
            _fill(sampling.choice, value)
        else:
            del sampling.choice.choices[:]
            sampling.choice.choices.extend([value] if isinstance(value, str) else value)
        return
    setattr(sampling, name, value)


def _as_section(value, cls):
    if value is None:
        return cls()
    if isinstance(value, cls):
        out = cls()
        out.CopyFrom(value)
        return out
    out = cls()
    _fill(out, value)
    return out


def chat_messages(messages: ChatMessages) -> list[pb.ChatMessage]:
    """Accept [{"role":..,"content":..}] (OpenAI's message dicts: content a string or text parts,
    also name, tool_call_id and tool_calls [{"id", "function": {"name", "arguments"}}], arguments
    as JSON text or a dict), [("role", "content")] or ChatMessage objects."""
    out = []
    for m in messages:
        if isinstance(m, pb.ChatMessage):
            out.append(m)
        elif isinstance(m, Mapping):
            msg = pb.ChatMessage(role=m["role"], content=joined_text(m.get("content")))
            for key in ("name", "tool_call_id"):
                if m.get(key) is not None:
                    setattr(msg, key, m[key])
            for call in m.get("tool_calls") or ():
                fn = call.get("function", call)
                args = fn.get("arguments", "")
                msg.tool_calls.add(id=call.get("id", ""), name=fn["name"],
                                   arguments=args if isinstance(args, str) else json.dumps(args))
            out.append(msg)
        else:
            role, content = m
            out.append(pb.ChatMessage(role=role, content=joined_text(content)))
    return out


def _fill_chat(chat: pb.ChatPrompt, messages: ChatMessages, fields: Mapping[str, Any]) -> None:
    chat.messages.extend(chat_messages(messages))
    if fields.get("add_generation_prompt") is not None:
        chat.add_generation_prompt = fields["add_generation_prompt"]
    if fields.get("continue_final_message"):
        chat.continue_final_message = True
    for tool in fields.get("tools") or ():
        chat.tools.add().update(tool)
    if fields.get("chat_template_kwargs"):
        chat.chat_template_kwargs.update(fields["chat_template_kwargs"])


def build_generate_request(
    prompt: str | Sequence[int] | None = None,
    *,
    messages: ChatMessages | None = None,
    request_id: str | None = None,
    stream: bool = False,
    sampling: Mapping[str, Any] | pb.SamplingParams | None = None,
    stopping: Mapping[str, Any] | pb.StoppingCriteria | None = None,
    output: Mapping[str, Any] | pb.OutputOptions | None = None,
    **fields: Any,
) -> pb.GenerateRequest:
    """A GenerateRequest from a prompt (text, or a sequence of token ids) or chat `messages`.

    Keyword fields are proto field names, e.g. max_tokens=16, temperature=0.0, stop=["\\n"],
    logprobs=2, seed=1, json_schema={...}, labels={"tenant": "a"}. `sampling`, `stopping` and
    `output` may also be given whole (a dict or the message); keywords override them.
    """
    if (prompt is None) == (messages is None):
        raise TypeError("give exactly one of prompt (text or token ids) or messages (chat)")
    unknown = set(fields) - GENERATE_KWARGS
    if unknown:
        hint = " (OutputOptions.text/token_ids go in output={...})" if unknown & _OUTPUT_ONLY_VIA_DICT else ""
        raise TypeError(f"unknown generate arguments {sorted(unknown)}{hint}; "
                        f"valid: {sorted(GENERATE_KWARGS)}")
    req = pb.GenerateRequest(request_id=request_id or "", stream=stream)
    if messages is not None:
        _fill_chat(req.chat, messages, fields)
    elif isinstance(prompt, str):
        req.text = prompt
    else:
        req.token_ids.ids.extend(int(t) for t in prompt)
    misplaced = sorted(k for k in _CHAT if fields.get(k) is not None) if messages is None else []
    if misplaced:
        raise TypeError(f"{', '.join(misplaced)} apply to chat messages only")

    sections = {
        "sampling": (_as_section(sampling, pb.SamplingParams), _SAMPLING),
        "stopping": (_as_section(stopping, pb.StoppingCriteria), _STOPPING),
        "output": (_as_section(output, pb.OutputOptions), _OUTPUT),
    }
    for name, (msg, names) in sections.items():
        _fill(msg, {k: v for k, v in fields.items() if k in names})
        if msg.ListFields():
            getattr(req, name).CopyFrom(msg)
    _fill(req, {k: v for k, v in fields.items() if k in _TOP_LEVEL})
    return req


def build_tokenize_request(
    text: str | None = None,
    *,
    messages: ChatMessages | None = None,
    add_special_tokens: bool | None = None,
    add_generation_prompt: bool | None = None,
    return_offsets: bool = False,
    return_pieces: bool = False,
    **chat: Any,
) -> pb.TokenizeRequest:
    """A TokenizeRequest for text or chat messages (chat: continue_final_message, tools,
    chat_template_kwargs, as for generate)."""
    if (text is None) == (messages is None):
        raise TypeError("give exactly one of text or messages")
    if set(chat) - _CHAT:
        raise TypeError(f"unknown tokenize arguments {sorted(set(chat) - _CHAT)}")
    req = pb.TokenizeRequest(return_offsets=return_offsets, return_pieces=return_pieces)
    if messages is not None:
        _fill_chat(req.chat, messages, {**chat, "add_generation_prompt": add_generation_prompt})
    else:
        req.text = text
    if add_special_tokens is not None:
        req.add_special_tokens = add_special_tokens
    return req


def build_detokenize_request(token_ids: Sequence[int], *,
                             skip_special_tokens: bool | None = None) -> pb.DetokenizeRequest:
    req = pb.DetokenizeRequest(token_ids=[int(t) for t in token_ids])
    if skip_special_tokens is not None:
        req.skip_special_tokens = skip_special_tokens
    return req


def build_drain_request(grace_seconds: float | None = None) -> pb.DrainRequest:
    """grace_seconds None: unset, so the server's --shutdown-grace applies."""
    return pb.DrainRequest() if grace_seconds is None else pb.DrainRequest(grace_seconds=grace_seconds)
