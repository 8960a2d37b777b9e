"""Every validation rule of docs/api.md -> (status code, field) without a server; error details encoding."""
from __future__ import annotations

import math

import grpc
import pytest
from google.rpc import status_pb2

from llmsvc.engine.async_engine import EngineDeadError, OutputBacklogError
from llmsvc.core.errors import DuplicateRequestError, PromptTooLongError, QueueFullError
from llmsvc.server.errors import ServiceError, to_service_error
from llmsvc.server.prompt import resolve_prompt
from llmsvc.engine.admission import Admission
from llmsvc.server.v1_request import to_engine_request
from llmsvc.engine.validation import RequestLimits
from llmsvc.server.validation import ModelLimits, build_sampling_params
from llmsvc.v1 import llmsvc_pb2 as pb
from tests.reliability_utils import unpack_details
from tests.server_harness import tiny_tokenizer

LIMITS = ModelLimits(RequestLimits(vocab_size=259, max_len=64, max_n=4, max_stop_strings=8, max_logprobs=5),
                     generation_defaults={"temperature": 0.7, "top_k": 50})
TOK = tiny_tokenizer()


def req(**kw) -> pb.GenerateRequest:
    r = pb.GenerateRequest(text="hello")
    for part in ("sampling", "stopping", "output"):
        if part in kw:
            getattr(r, part).CopyFrom(kw.pop(part))
    for k, v in kw.items():
        if k == "token_ids":
            r.token_ids.CopyFrom(pb.TokenIds(ids=v))
        else:
            setattr(r, k, v)
    return r


def full_check(r: pb.GenerateRequest):
    """The server's path without a server: this door's mapper, then the engine's admission."""
    try:
        admitted = Admission(LIMITS.request_limits, tokenizer=TOK).admit(to_engine_request(r, "r", TOK, LIMITS))
    except ServiceError:
        raise
    except Exception as e:  # what the servicer does with an engine error
        raise to_service_error(e) from None
    return admitted.request.sampling_params, admitted.request.prompt_token_ids


S, ST, O = pb.SamplingParams, pb.StoppingCriteria, pb.OutputOptions
CASES = [
    (req(sampling=S(temperature=-0.1)), "sampling.temperature"),
    (req(sampling=S(temperature=math.nan)), "sampling.temperature"),
    (req(sampling=S(temperature=math.inf)), "sampling.temperature"),
    (req(sampling=S(top_p=0.0)), "sampling.top_p"),
    (req(sampling=S(top_p=1.5)), "sampling.top_p"),
    (req(sampling=S(top_k=-2)), "sampling.top_k"),
    (req(sampling=S(top_k=100000)), "sampling.top_k"),
    (req(sampling=S(min_p=1.01)), "sampling.min_p"),
    (req(sampling=S(presence_penalty=2.5)), "sampling.presence_penalty"),
    (req(sampling=S(frequency_penalty=-3)), "sampling.frequency_penalty"),
    (req(sampling=S(repetition_penalty=0.0)), "sampling.repetition_penalty"),
    (req(sampling=S(n=0)), "sampling.n"),
    (req(sampling=S(n=5)), "sampling.n"),
    (req(sampling=S(logit_bias={300: 1.0})), "sampling.logit_bias"),
    (req(sampling=S(logit_bias={3: 101.0})), "sampling.logit_bias[3]"),
    (req(stopping=ST(max_tokens=0)), "stopping.max_tokens"),
    (req(stopping=ST(max_tokens=60)), "stopping.max_tokens"),  # 5 prompt + 60 > 64
    (req(stopping=ST(max_tokens=3, min_tokens=4)), "stopping.min_tokens"),
    (req(stopping=ST(stop=["ok", ""])), "stopping.stop[1]"),
    (req(stopping=ST(stop=["s"] * 9)), "stopping.stop"),
    (req(stopping=ST(stop=["x" * 2000])), "stopping.stop[0]"),
    (req(stopping=ST(stop_token_ids=[1000])), "stopping.stop_token_ids[0]"),
    # bounded like stop strings: each word is tokenized at admission
    (req(sampling=S(bad_words=["ok", "x" * 2000])), "sampling.bad_words[1]"),
    # at most one per vocabulary entry, refused before the ids are copied (a 10M-id request
    # once slowed every step of the batch)
    (req(sampling=S(allowed_token_ids=[7] * 260)), "sampling.allowed_token_ids"),
    (req(output=O(logprobs=6)), "output.logprobs"),
    (req(output=O(prompt_logprobs=99)), "output.prompt_logprobs"),
    (pb.GenerateRequest(), "prompt"),
    (req(text=""), "text"),
    (req(token_ids=[]), "token_ids.ids"),
    (req(token_ids=[1, 259]), "token_ids.ids[1]"),
    (pb.GenerateRequest(chat=pb.ChatPrompt()), "chat.messages"),
    (pb.GenerateRequest(chat=pb.ChatPrompt(messages=[pb.ChatMessage(role="wizard", content="x")])),
     "chat.messages[0].role"),
    (req(text="x" * 10, truncate_prompt_tokens=0), "truncate_prompt_tokens"),
    (req(text="x" * 10, truncate_prompt_tokens=64), "truncate_prompt_tokens"),
]


@pytest.mark.parametrize("r,field", CASES, ids=[c[1] + f"#{i}" for i, c in enumerate(CASES)])
def test_each_rule_is_invalid_argument_with_field(r, field):
    with pytest.raises(ServiceError) as ei:
        full_check(r)
    err = ei.value
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT
    assert err.field == field
    assert field in err.message
    details = _details(err)
    assert [v.field for v in details["BadRequest"].field_violations] == [field]
    # the description says what is wrong, the field it is about is named once, in `field`
    description = details["BadRequest"].field_violations[0].description
    assert description and not description.startswith(field) and description in err.message
    assert details["ErrorInfo"].domain == "llmsvc"


def _details(err: ServiceError) -> dict:
    st = err.to_status("rid-1")
    md = dict(st.trailing_metadata)
    s = status_pb2.Status.FromString(md["grpc-status-details-bin"])
    assert s.code == err.code.value[0] and s.message == err.message
    return unpack_details(s)


def test_allowed_token_ids_repeats_count_once():
    params, _ = full_check(req(sampling=S(allowed_token_ids=[7, 3, 7, 7, 3])))
    assert params.allowed_token_ids == [7, 3]


def test_abort_ids_are_bounded():
    from llmsvc.server.validation import check_abort_ids
    check_abort_ids(["a"] * 10, 10)
    with pytest.raises(ServiceError, match="at most 10 ids") as ei:
        check_abort_ids(["a"] * 11, 10)
    assert ei.value.field == "request_ids"


def test_prompt_too_long_has_reason_and_metadata():
    with pytest.raises(ServiceError) as ei:
        full_check(req(text="y" * 64))
    err = ei.value
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT and err.reason == "PROMPT_TOO_LONG"
    info = _details(err)["ErrorInfo"]
    assert info.reason == "PROMPT_TOO_LONG" and info.metadata["prompt_tokens"] == "64"
    assert info.metadata["max_model_len"] == "64"
    with pytest.raises(ServiceError) as ei:  # min_tokens counts too
        full_check(req(text="y" * 40, stopping=ST(min_tokens=30)))
    assert ei.value.reason == "PROMPT_TOO_LONG"


def test_truncation_keeps_last_tokens():
    params, ids = full_check(req(text="abcdefghij" * 10, truncate_prompt_tokens=5))
    assert ids == list(b"fghij")
    assert params.max_tokens is None  # unset => fill the context


def test_constraint_kind_not_served_is_unimplemented():
    limits = ModelLimits(RequestLimits(vocab_size=259, max_len=64), supported_constraints=("json_schema",))
    with pytest.raises(ServiceError) as ei:
        build_sampling_params(req(sampling=S(regex="a+")), limits)
    assert ei.value.code == grpc.StatusCode.UNIMPLEMENTED and "sampling.regex" in ei.value.message


def test_chat_without_template_is_failed_precondition():
    r = pb.GenerateRequest(chat=pb.ChatPrompt(messages=[pb.ChatMessage(role="user", content="hi")]))
    with pytest.raises(ServiceError) as ei:
        resolve_prompt(r, tiny_tokenizer(chat_template=False), LIMITS)
    assert ei.value.code == grpc.StatusCode.FAILED_PRECONDITION
    _, ids = resolve_prompt(r, TOK, LIMITS)
    assert TOK.decode(ids) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_defaults_from_generation_config_then_neutral():
    p, _ = full_check(req())
    assert (p.temperature, p.top_k, p.top_p, p.min_p, p.repetition_penalty, p.n) == (0.7, 50, 1.0, 0.0, 1.0, 1)
    assert p.max_tokens is None and p.logprobs is None and p.skip_special_tokens
    assert 0 <= p.seed < 2 ** 62  # unseeded sampling: admission draws one (echoed in FinishInfo.seed)
    p, _ = full_check(req(sampling=S(temperature=0.0, top_k=-1, seed=7, n=2),
                          stopping=ST(max_tokens=4, stop=["x"], stop_token_ids=[5], ignore_eos=True),
                          output=O(logprobs=0, skip_special_tokens=False)))
    assert (p.temperature, p.top_k, p.seed, p.n, p.max_tokens) == (0.0, 0, 7, 2, 4)
    assert (p.stop, p.stop_token_ids, p.ignore_eos, p.logprobs, p.skip_special_tokens) == (["x"], [5], True, 0, False)


@pytest.mark.parametrize("exc,code", [
    (PromptTooLongError(100, 64), grpc.StatusCode.INVALID_ARGUMENT),
    (DuplicateRequestError("a"), grpc.StatusCode.ALREADY_EXISTS),
    (QueueFullError("full"), grpc.StatusCode.RESOURCE_EXHAUSTED),
    (OutputBacklogError("slow"), grpc.StatusCode.RESOURCE_EXHAUSTED),
    (EngineDeadError("dead"), grpc.StatusCode.UNAVAILABLE),
    (KeyError("boom"), grpc.StatusCode.INTERNAL),
])
def test_engine_errors_map_to_status(exc, code):
    err = to_service_error(exc)
    assert err.code == code
    details = _details(err)
    if isinstance(exc, (QueueFullError, EngineDeadError)):
        assert details["RetryInfo"].retry_delay.seconds >= 1
    if code == grpc.StatusCode.INTERNAL:
        assert details["ErrorInfo"].metadata["request_id"] == "rid-1"
        assert "Traceback" not in err.message and "boom" not in err.message



@pytest.mark.parametrize("exc", [EngineDeadError("engine loop died: ExecutorError: worker failed:\nTraceback (most "
                                                 "recent call last):\n" + "  File x, line 1\n" * 500),
                                 EngineDeadError("engine loop died: " + "x" * 9000)])
def test_engine_death_tells_the_client_one_bounded_line(exc):
    """A worker's traceback stays in the server's log: sent whole it passed the client's 8 KiB
    trailer limit, and the client saw RESOURCE_EXHAUSTED instead of UNAVAILABLE."""
    err = to_service_error(exc)
    assert err.code == grpc.StatusCode.UNAVAILABLE and err.reason == "ENGINE_DEAD"
    assert "\n" not in err.message and "Traceback" not in err.message and len(err.message) < 400
    assert err.message.startswith("engine is not running: engine loop died: ")



def test_stream_interval_from_output_options():
    assert build_sampling_params(req(stream=True), LIMITS).stream_interval is None  # the server's
    assert build_sampling_params(req(stream=True, output=O(stream_interval=0)), LIMITS).stream_interval is None
    assert build_sampling_params(req(stream=True, output=O(stream_interval=8)), LIMITS).stream_interval == 8
