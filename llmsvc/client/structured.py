"""Helpers for structured output requests (plain dicts; no torch, no engine).

Constraints themselves are ordinary keyword arguments of Client.generate / generate_stream /
build_generate_request: json_schema= (a dict or JSON text), regex=, choice= (a list),
grammar=, json_object=True. `function_call_schema` builds the JSON Schema that makes the
model answer with one call of one of the given functions:

    schema = function_call_schema([{"name": "get_weather", "parameters": {...}}])
    result = client.generate(messages=[...], json_schema=schema, temperature=0.0)
    call = json.loads(result.text)   # {"name": "get_weather", "arguments": {...}}
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

_NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}


def function_call_schema(functions: Sequence[Mapping[str, Any]]) -> dict:
    """JSON Schema of {"name": <one of the functions>, "arguments": <its parameters>}.

    Each function is {"name", "parameters" (a JSON Schema), "description"?}, or the OpenAI tool
    form {"type": "function", "function": {...}}."""
    if not functions:
        raise ValueError("function_call_schema needs at least one function")
    alternatives = []
    for f in functions:
        f = f.get("function", f) if f.get("type") == "function" else f
        name = f.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"every function needs a non-empty 'name', got {f!r}")
        alternatives.append({
            "type": "object",
            "properties": {"name": {"const": name}, "arguments": dict(f.get("parameters") or _NO_ARGUMENTS)},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        })
    return alternatives[0] if len(alternatives) == 1 else {"anyOf": alternatives}
