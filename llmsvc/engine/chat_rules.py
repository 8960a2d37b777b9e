"""What a chat request may hold, for every door (torch-free): the gRPC services check their
proto messages against these facts (llmsvc.server.validation), the offline LLM.chat its dicts
(check_chat_dicts), so a conversation one door refuses the other refuses too. Also the offline
messages' tool-call arguments parsed from JSON (text content parts: llmsvc.chat_content)."""
from __future__ import annotations

import json

from llmsvc.core.errors import InvalidRequestError

CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")
MAX_TOOLS = 128
# apply_chat_template's own parameters: not template variables a request may set
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "sanitize_control_tokens"})


def check_chat_dicts(messages: list, template_kwargs: dict, tools: list | None) -> list[dict]:
    """One conversation of OpenAI-style message dicts (InvalidRequestError naming the first bad
    field); returns the messages with a missing content as "" (a gRPC ChatMessage's default)."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages", "must be a non-empty list of message dicts")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise InvalidRequestError(f"messages[{i}]", f"must be a dict, got {type(m).__name__}")
        if m.get("role") not in CHAT_ROLES:
            raise InvalidRequestError(f"messages[{i}].role", f"must be one of {', '.join(CHAT_ROLES)}, "
                                      f"got {m.get('role')!r}")
        out.append(m if m.get("content") is not None else {**m, "content": ""})
    if tools is not None and len(tools) > MAX_TOOLS:
        raise InvalidRequestError("tools", f"at most {MAX_TOOLS} tools, got {len(tools)}")
    reserved = sorted(set(template_kwargs) & RESERVED_TEMPLATE_KWARGS)
    if reserved:
        raise InvalidRequestError("chat_template_kwargs", f"{', '.join(reserved)} cannot be set here "
                                  "(use the method's own arguments)")
    return out


def parsed_tool_calls(message: dict) -> dict:
    """OpenAI's tool calls carry their arguments as JSON text; templates write them with tojson
    and expect an object (as the gRPC server hands them over)."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    out = []
    for c in calls:
        fn = c.get("function", {})
        if isinstance(fn.get("arguments"), str):
            fn = {**fn, "arguments": json.loads(fn["arguments"]) if fn["arguments"] else {}}
            c = {**c, "function": fn}
        out.append(c)
    return {**message, "tool_calls": out}
