"""Structured output over gRPC (LlmServer on loopback, real engine on the FakeExecutor): the five
kinds end "stop" with conforming text, and every kind of bad constraint is INVALID_ARGUMENT with a
field violation naming the proto field, while a concurrent stream goes on and no KV block leaks."""
from __future__ import annotations

import json
import re
import threading

import grpc
import pytest

from llmsvc.client.request import build_generate_request
from llmsvc.v1 import llmsvc_pb2 as pb
from tests.reliability_utils import rpc_details
from tests.server_harness import ServerThread, fake_engine_factory
from tests.test_server import free_blocks_back

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "tag": {"enum": ["a", "b"]}},
          "required": ["ok", "tag"], "additionalProperties": False}


@pytest.fixture(scope="module")
def srv():
    s = ServerThread(fake_engine_factory(num_blocks=64, step_delay=0.002, max_model_len=256))
    yield s
    s.stop()


def generate(srv, **kw):
    req = build_generate_request("hello", max_tokens=kw.pop("max_tokens", 40), temperature=0.0, **kw)
    (msg,) = list(srv.stub.Generate(req))
    return msg


@pytest.mark.parametrize("kw,check", [
    (dict(json_schema=SCHEMA), lambda t: json.loads(t)["tag"] in "ab"),
    (dict(regex=r"[a-z]{3}\.[0-9]"), lambda t: re.fullmatch(r"[a-z]{3}\.[0-9]", t)),
    (dict(choice=["left", "right"]), lambda t: t in ("left", "right")),
    (dict(grammar='root ::= "<" [a-z] [a-z]? ">"'), lambda t: re.fullmatch(r"<[a-z]{1,2}>", t)),
    (dict(json_object=True, max_tokens=200), lambda t: isinstance(json.loads(t), dict)),
    (dict(json_schema=True, max_tokens=200), lambda t: json.loads(t) is not None or t == "null"),  # schema true
])
def test_each_kind_over_the_wire(srv, kw, check):
    msg = generate(srv, **kw)
    assert check(msg.text), msg.text
    assert msg.finish.reason == pb.FinishInfo.REASON_STOP


def _bad(**sampling) -> pb.GenerateRequest:
    return pb.GenerateRequest(text="hello", sampling=pb.SamplingParams(**sampling),
                              stopping=pb.StoppingCriteria(max_tokens=8))


BAD = [
    (_bad(json_schema='{"type": '), "sampling.json_schema", "INVALID_JSON", "not valid JSON"),
    (_bad(json_schema="[1, 2]"), "sampling.json_schema", "INVALID_SCHEMA", "JSON Schema"),
    (_bad(json_schema='{"type": "strnig"}'), "sampling.json_schema", "INVALID_SCHEMA", "strnig"),
    (_bad(json_schema='{"not": {"type": "string"}}'), "sampling.json_schema", "UNSUPPORTED_SCHEMA_FEATURE",
     "not"),
    (_bad(regex="a(b"), "sampling.regex", "INVALID_REGEX", "unclosed group"),
    (_bad(regex=""), "sampling.regex", "INVALID_REGEX", "empty"),
    (_bad(choice=pb.Choices()), "sampling.choice.choices", "INVALID_CHOICE", "at least one"),
    (_bad(choice=pb.Choices(choices=["a", ""])), "sampling.choice.choices[1]", "INVALID_CHOICE", "empty"),
    (_bad(grammar="this is not a grammar"), "sampling.grammar", "INVALID_GRAMMAR", "grammar"),
    (_bad(grammar="start: undefined_rule"), "sampling.grammar", "INVALID_GRAMMAR", "undefined_rule"),
    (_bad(json_object=False), "sampling.json_object", "INVALID_SCHEMA", "true"),
    (_bad(json_schema="[" * 5000 + "]" * 5000), "sampling.json_schema", "INVALID_JSON", "nests too deeply"),
    (_bad(json_schema="false"), "sampling.json_schema", "INVALID_SCHEMA", "no JSON value matches it"),
    (_bad(json_schema='{"oneOf": [{"type": "integer"}, {"type": "number"}]}'), "sampling.json_schema",
     "UNSUPPORTED_SCHEMA_FEATURE", "use anyOf"),  # the hint named an option users cannot set
    # no text satisfies these: they used to finish "stop" with an empty output
    (_bad(regex="[a&&b]"), "sampling.regex", "INVALID_REGEX", "not satisfiable"),
    (_bad(json_schema='{"$ref": "#"}'), "sampling.json_schema", "INVALID_SCHEMA", "not satisfiable"),
    # valid, but past the lexer's limits on the first token: they used to end "abort" at once,
    # blaming token rules the request never set
    (_bad(regex="a{2000000}"), "sampling.regex", "INVALID_REGEX", "too large for the grammar engine"),
    (_bad(json_schema='{"type": "string", "pattern": "^(a{1000}){1000}$"}'), "sampling.json_schema",
     "INVALID_SCHEMA", "too large for the grammar engine"),
]


@pytest.mark.parametrize("request_,field,reason,says", BAD, ids=[f"{b[2]}-{i}" for i, b in enumerate(BAD)])
def test_bad_constraint_is_invalid_argument_and_disturbs_nothing(srv, request_, field, reason, says):
    # a long unconstrained stream runs across the failing call and must finish normally
    bystander = []
    t = threading.Thread(target=lambda: bystander.extend(srv.stub.Generate(
        pb.GenerateRequest(text="bystander", stream=True, stopping=pb.StoppingCriteria(max_tokens=60)))))
    t.start()
    with pytest.raises(grpc.RpcError) as ei:
        list(srv.stub.Generate(request_))
    t.join(30)
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    d = rpc_details(ei.value)
    violation = d["BadRequest"].field_violations[0]
    assert violation.field == field and says in violation.description, violation
    assert d["ErrorInfo"].reason == reason and d["ErrorInfo"].domain == "llmsvc"
    assert bystander[-1].finish.reason == pb.FinishInfo.REASON_LENGTH
    assert sum(len(m.token_ids) for m in bystander) == 60
    free_blocks_back(srv)


def test_compile_time_limit_is_invalid_argument(srv):
    mgr = srv.engine.structured_output_manager
    old, mgr.compile_timeout_s = mgr.compile_timeout_s, 1e-9
    try:
        with pytest.raises(grpc.RpcError) as ei:
            list(srv.stub.Generate(_bad(regex="[a-z]{7}q")))
    finally:
        mgr.compile_timeout_s = old
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    d = rpc_details(ei.value)
    assert d["ErrorInfo"].reason == "COMPILE_TIMEOUT"
    assert d["BadRequest"].field_violations[0].field == "sampling.regex"
    free_blocks_back(srv)
    assert generate(srv, regex=r"[a-z]{2}").finish.reason == pb.FinishInfo.REASON_STOP  # server fine


def test_model_info_lists_every_kind(srv):
    info = srv.stub.GetModelInfo(pb.GetModelInfoRequest())
    assert sorted(info.supported_constraints) == ["choice", "grammar", "json_object", "json_schema", "regex"]


def test_client_function_call(srv):
    import jsonschema

    from llmsvc.client import Client, InvalidArgument, function_call_schema

    tools = [{"type": "function", "function": {"name": "get_time", "parameters": None}},
             {"name": "get_weather", "parameters": {
                 "type": "object", "properties": {"city": {"type": "string", "maxLength": 5}},
                 "required": ["city"], "additionalProperties": False}}]
    schema = function_call_schema(tools)
    with Client(srv.address) as c:
        result = c.generate(messages=[{"role": "user", "content": "weather?"}], json_schema=schema,
                            temperature=0.0, max_tokens=60)
        call = json.loads(result.text)
        jsonschema.validate(call, schema)
        assert call["name"] in ("get_time", "get_weather") and result.finish_reason == "stop"
        with pytest.raises(InvalidArgument) as ei:
            c.generate("x", regex="(", max_tokens=4)
        assert "sampling.regex" in str(ei.value)
    with pytest.raises(ValueError):
        function_call_schema([])


def test_compile_timeout_flag_and_env(monkeypatch):
    import argparse

    from llmsvc.server import cli

    def config(argv):
        p = argparse.ArgumentParser()
        cli.add_arguments(p)
        return cli.build_config(p.parse_args(argv))

    assert config([]).grammar_compile_timeout_s == 10.0
    assert config(["--grammar-compile-timeout", "0.5"]).grammar_compile_timeout_s == 0.5
    monkeypatch.setenv("LLMSVC_GRAMMAR_COMPILE_TIMEOUT", "2.5")
    monkeypatch.setenv("LLMSVC_GRAMMAR_CACHE_SIZE", "7")
    c = config([])
    assert c.grammar_compile_timeout_s == 2.5 and c.grammar_cache_size == 7


def test_abort_a_constrained_stream(srv):
    req = build_generate_request("hello", request_id="so-abort", stream=True, regex="[a-z]{200}",
                                 max_tokens=200, temperature=0.0)
    stream = srv.stub.Generate(req)
    first = next(stream)
    assert first.request_id == "so-abort"
    assert list(srv.stub.Abort(pb.AbortRequest(request_ids=["so-abort"])).aborted) == ["so-abort"]
    last = list(stream)[-1]
    assert last.finish.reason == pb.FinishInfo.REASON_ABORTED
    free_blocks_back(srv)

