"""The SMG gateway with a tool parser that constrains tool calls by structural tag (mistral):
`tool_choice` "required" or a named function reaches llmsvc as `structural_tag` on vLLM's door,
and the reply's tool calls are the gateway's parse of what the tag let the model write (a tiny
random Llama: only the constraint makes its output a call)."""
from __future__ import annotations

import json

import pytest

from tests.ascii_model import make_ascii_served_model_dir
from tests.smg_utils import smg_fleet

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
    "required": ["city"], "additionalProperties": False}}}]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    d = make_ascii_served_model_dir(tmp_path_factory.mktemp("smg-tools"), max_position_embeddings=4096)
    with smg_fleet(d, replicas=1, smg_args=("--tool-call-parser", "mistral")) as f:
        yield f


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_required_and_named_tool_calls_hold_to_the_schema(fleet, choice):
    # a call is at most 72 tokens ('[TOOL_CALLS] [' + the object with a city of 8 bytes; a token
    # is a byte here): 120 leave room for one whole call whatever the model fills in; the random
    # model then goes on with ", " and more calls until the budget ends them (finish "length")
    status, body = fleet.post("/v1/chat/completions", {
        "model": fleet.model, "messages": [{"role": "user", "content": "weather?"}], "tools": TOOLS,
        "tool_choice": choice, "max_tokens": 120, "temperature": 0})
    assert status == 200, body  # was 400: the worker refused the structural tag
    calls = body["choices"][0]["message"]["tool_calls"]
    assert calls and all(c["function"]["name"] == "get_weather" for c in calls)
    for c in calls:
        args = json.loads(c["function"]["arguments"])
        assert set(args) == {"city"} and isinstance(args["city"], str) and len(args["city"]) <= 8
