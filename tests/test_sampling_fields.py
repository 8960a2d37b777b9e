"""Every declared SamplingParams field holds to its declaration end to end, and a served request
is checked once.

A field's Facts (llmsvc.sampling_fields) name its proto path, range, generation_config default
and `llmsvc generate` flag; these tests hold each declared field to all of them: the proto has
the path, the flag is in --help, the llmsvc.v1 door carries a set value into the EngineRequest
(and an unset one takes the model's default), an out-of-range value is INVALID_ARGUMENT on that
path, and a sampling field reaches a sampler stage that reads it.
"""
from __future__ import annotations

import argparse
from unittest import mock

import grpc
import pytest

from llmsvc.client import cli as client_cli
from llmsvc.engine import admission, validation
from llmsvc.engine.admission import Admission
from llmsvc.engine.lora_registry import LoRARegistry
from llmsvc.sampling_fields import declared
from llmsvc.sampling_params import GENERATION_DEFAULTS, SamplingParams
from llmsvc.server.errors import ServiceError, to_service_error
from llmsvc.server.v1_request import to_engine_request
from llmsvc.engine.validation import RequestLimits
from llmsvc.server.validation import ModelLimits
from llmsvc.v1 import llmsvc_pb2 as pb
from llmsvc.worker.sampling_metadata import SamplingMetadata
from llmsvc.worker.stages import registered
from tests.server_harness import ServerThread, fake_engine_factory, tiny_tokenizer

DECLARED = [(f.name, f.default, facts) for f, facts in declared(SamplingParams)]
NUMBERS = [(name, facts) for name, _, facts in DECLARED if facts.kind]
TOK = tiny_tokenizer()
LIMITS = ModelLimits(RequestLimits(vocab_size=259, max_len=64, max_n=4, max_logprobs=5),
                     generation_defaults={"temperature": 0.7, "top_k": 50})


def inside(facts, default):
    """A value in the field's range that differs from its default."""
    if facts.kind == "int":
        return (int(facts.lo or 0) + 2) if default != int(facts.lo or 0) + 2 else int(facts.lo or 0) + 3
    lo = facts.lo if facts.lo is not None else -1.0
    hi = facts.hi if facts.hi is not None else lo + 2.0
    value = lo + (hi - lo) * 0.25
    return value if value != default else lo + (hi - lo) * 0.75


def outside(facts):
    """A value below the field's range (every declared number field has a lower bound)."""
    assert facts.lo is not None
    return (int(facts.lo) - 5) if facts.kind == "int" else facts.lo - (1.0 if not facts.lo_open else 0.0)


def v1_request(**fields) -> pb.GenerateRequest:
    req = pb.GenerateRequest(text="hello")
    for name, value in fields.items():
        facts = dict((n, f) for n, _, f in DECLARED)[name]
        part = getattr(req, facts.proto_parent) if facts.proto_parent else req
        if isinstance(value, list):
            getattr(part, facts.proto_name).extend(value)
        else:
            setattr(part, facts.proto_name, value)
    return req


def through_the_door(req: pb.GenerateRequest) -> SamplingParams:
    try:
        return Admission(LIMITS.request_limits, tokenizer=TOK).admit(
            to_engine_request(req, "r", TOK, LIMITS)).request.sampling_params
    except ServiceError:
        raise
    except Exception as e:
        raise to_service_error(e) from None


@pytest.mark.parametrize("name,default,facts", DECLARED, ids=[d[0] for d in DECLARED])
def test_the_declared_proto_path_exists(name, default, facts):
    msg = pb.GenerateRequest.DESCRIPTOR
    for part in facts.proto.split("."):
        assert part in msg.fields_by_name, f"{name}: {facts.proto} is not a GenerateRequest path"
        field = msg.fields_by_name[part]
        msg = field.message_type
    assert field.name == facts.proto_name


def test_every_declared_flag_is_in_llmsvc_generate_help():
    parser = argparse.ArgumentParser(prog="llmsvc generate")
    client_cli.add_arguments(parser)
    text = parser.format_help()
    flagged = [(name, facts) for name, _, facts in DECLARED if facts.cli]
    assert len(flagged) >= 15
    for name, facts in flagged:
        flag = facts.flag or "--" + name.replace("_", "-")
        assert flag in text, flag
        assert parser.parse_args(["p"]).__dict__[name] is None  # unset: left to the server


@pytest.mark.parametrize("name,facts", NUMBERS, ids=[n for n, _ in NUMBERS])
def test_a_number_field_crosses_the_door_and_its_range_is_checked_on_its_path(name, facts):
    default = dict((n, d) for n, d, _ in DECLARED)[name]
    value = inside(facts, default)
    extra = {"max_tokens": 50} if name == "min_tokens" else {}
    params = through_the_door(v1_request(**{name: value}, **extra))
    assert getattr(params, name) == pytest.approx(value), name
    if facts.kind == "int" and facts.lo is not None and facts.lo - 5 < 0 and facts.proto_name in (
            "n", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs", "seed", "time_limit_ms",
            "stream_interval"):
        return  # an unsigned proto field cannot carry a value below 0 (the proto refuses it first)
    with pytest.raises(ServiceError) as ei:
        through_the_door(v1_request(**{name: outside(facts)}))
    assert ei.value.code == grpc.StatusCode.INVALID_ARGUMENT and ei.value.field == facts.proto, ei.value.message


@pytest.mark.parametrize("name", sorted(GENERATION_DEFAULTS))
def test_an_unset_tunable_takes_the_model_default_then_its_neutral_value(name):
    params = through_the_door(v1_request())
    expected = LIMITS.generation_defaults.get(name, GENERATION_DEFAULTS[name])
    assert getattr(params, name) == pytest.approx(expected)


def test_every_sampling_field_reaches_a_stage_that_reads_it():
    read = {f: s for s in registered() for f in s.fields}
    assert set(read) <= {name for name, _, _ in DECLARED}  # stages read declared fields only
    # the sampling message's fields act in the sampler, but n (fan-out) and seed (generators)
    sampling = [n for n, _, facts in DECLARED if facts.proto_parent == "sampling" and n not in ("n", "seed")]
    for name in sampling + ["min_tokens"]:
        assert name in read, f"no sampler stage reads {name}"
        default = dict((n, d) for n, d, _ in DECLARED)[name]
        facts = dict((n, f) for n, _, f in DECLARED)[name]
        value = {"logit_bias": {3: 1.5}, "allowed_token_ids": [3, 4], "bad_words": ["ab"],
                 "min_tokens": 3}.get(name) or inside(facts, default)
        params = SamplingParams(**{"temperature": 0.8, name: value})
        if name == "bad_words":
            params.bad_words_token_ids = [[97, 98]]
        md = SamplingMetadata.build([params], [[1, 2]], [[97]], 259, eos_token_ids=[256])
        assert md.stage(read[name].name) is not None, name
        neutral = SamplingMetadata.build([SamplingParams(temperature=0.8)], [[1, 2]], [[97]], 259)
        assert neutral.stage(read[name].name) is None or name == "temperature", name


def test_a_served_request_is_checked_once():
    """verify(), the engine's rules, the cache salt, the LoRA lookup and the duplicate-id check
    each run once per request served over llmsvc.v1 (they ran two to five times before admission
    existed); the scheduler keeps only its own invariant that an id is new to it."""
    from llmsvc.engine import async_engine, llm_engine, request_ids

    counts = {"verify": 0, "check_request": 0, "check_cache_salt": 0, "lookup": 0, "check_free": 0}

    def counting(key, fn):
        def wrapped(*a, **kw):
            counts[key] += 1
            return fn(*a, **kw)
        return wrapped

    with mock.patch.object(SamplingParams, "verify", counting("verify", SamplingParams.verify)), \
            mock.patch.object(admission, "check_request", counting("check_request", validation.check_request)), \
            mock.patch.object(admission, "check_cache_salt", counting("check_cache_salt", validation.check_cache_salt)), \
            mock.patch.object(LoRARegistry, "lookup", counting("lookup", LoRARegistry.lookup)), \
            mock.patch.object(async_engine, "check_free", counting("check_free", request_ids.check_free)), \
            mock.patch.object(llm_engine, "check_free", counting("check_free", request_ids.check_free)):
        with ServerThread(fake_engine_factory()) as s:
            counts.update(dict.fromkeys(counts, 0))  # the server's own warm-up request is not ours
            req = pb.GenerateRequest(text="hello", cache_salt="tenant-a",
                                     sampling=pb.SamplingParams(temperature=0.9, seed=3),
                                     stopping=pb.StoppingCriteria(max_tokens=3))
            out = list(s.stub.Generate(req, timeout=30))
    assert out[-1].finish.reason == pb.FinishInfo.REASON_LENGTH
    assert counts == {"verify": 1, "check_request": 1, "check_cache_salt": 1, "lookup": 1, "check_free": 1}, counts
