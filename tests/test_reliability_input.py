"""Bad input against a LIVE server (tiny random Llama, uniproc, small KV pool): every mistake gets
its status code and a message naming the field, oversized messages are refused by grpc, fields
from a newer client are ignored, and a hypothesis fuzzer over GenerateRequest never gets INTERNAL.
Afterwards: all KV blocks free, nothing in flight, SERVING, and a concurrent witness stream exact.
"""
from __future__ import annotations

import itertools
import math
import threading

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmsvc.v1 import llmsvc_pb2 as pb
from tests.reliability_utils import (GREEDY, MAX_MODEL_LEN, ST, Witness, assert_invariants, live_server,
                                     rpc_details, tiny_model_dir)
from tests.sample_compare import assert_logprobs_close
from tests.server_harness import TINY_VOCAB

S, O = pb.SamplingParams, pb.OutputOptions
INVALID = grpc.StatusCode.INVALID_ARGUMENT


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    model_dir = tiny_model_dir(tmp_path_factory)
    s = live_server(model_dir)
    s.model_dir = model_dir
    witness = Witness(s, 0, max_tokens=200, read_delay=0.02).start()  # streams alongside the bad input
    yield s
    try:
        witness.check()
        assert_invariants(s)
    finally:
        s.stop()


def text_req(text="hello there", **kw) -> pb.GenerateRequest:
    kw.setdefault("stopping", ST(max_tokens=4))
    return pb.GenerateRequest(text=text, **kw)


def _set(msg, **fields):
    for k, v in fields.items():
        setattr(msg, k, v)
    return msg


BAD = [  # (request, field the status must name, ErrorInfo.reason or None)
    (pb.GenerateRequest(), "prompt", None),
    (pb.GenerateRequest(text=""), "text", None),
    (pb.GenerateRequest(token_ids=pb.TokenIds()), "token_ids.ids", None),
    (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5] * MAX_MODEL_LEN)), "prompt", "PROMPT_TOO_LONG"),
    (pb.GenerateRequest(text="y" * 400), "prompt", "PROMPT_TOO_LONG"),
    (pb.GenerateRequest(text="y" * 400, truncate_prompt_tokens=MAX_MODEL_LEN), "truncate_prompt_tokens", None),
    (pb.GenerateRequest(text="y" * 400, truncate_prompt_tokens=0), "truncate_prompt_tokens", None),
    (pb.GenerateRequest(text="y" * 300, truncate_prompt_tokens=250, stopping=ST(max_tokens=10)),
     "stopping.max_tokens", None),  # truncated prompt still leaves no room for 10 tokens
    (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2, TINY_VOCAB])), "token_ids.ids[2]", None),
    (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[2 ** 32 - 1])), "token_ids.ids[0]", None),
    (text_req(sampling=S(temperature=-0.5)), "sampling.temperature", None),
    (text_req(sampling=S(temperature=math.nan)), "sampling.temperature", None),
    (text_req(sampling=S(temperature=math.inf)), "sampling.temperature", None),
    (text_req(sampling=S(top_p=0.0)), "sampling.top_p", None),
    (text_req(sampling=S(top_p=1.0001)), "sampling.top_p", None),
    (text_req(sampling=S(top_p=math.nan)), "sampling.top_p", None),
    (text_req(sampling=S(min_p=1.5)), "sampling.min_p", None),
    (text_req(sampling=S(min_p=-math.inf)), "sampling.min_p", None),
    (text_req(sampling=S(top_k=-7)), "sampling.top_k", None),
    (text_req(sampling=S(presence_penalty=math.inf)), "sampling.presence_penalty", None),
    (text_req(sampling=S(frequency_penalty=-2.5)), "sampling.frequency_penalty", None),
    (text_req(sampling=S(repetition_penalty=-1.0)), "sampling.repetition_penalty", None),
    (text_req(sampling=S(repetition_penalty=math.nan)), "sampling.repetition_penalty", None),
    (text_req(sampling=S(n=1_000_000)), "sampling.n", None),
    (text_req(sampling=S(n=0)), "sampling.n", None),
    (text_req(sampling=S(seed=2 ** 64 - 1)), "sampling.seed", None),
    (text_req(sampling=S(logit_bias={7: math.nan})), "sampling.logit_bias[7]", None),
    (text_req(sampling=S(logit_bias={TINY_VOCAB + 1: 1.0})), "sampling.logit_bias", None),
    (text_req(stopping=ST(max_tokens=0)), "stopping.max_tokens", None),
    (text_req(stopping=ST(max_tokens=MAX_MODEL_LEN)), "stopping.max_tokens", None),
    (text_req(stopping=ST(max_tokens=MAX_MODEL_LEN - 3)), "stopping.max_tokens", None),  # + prompt > context
    (text_req(stopping=ST(max_tokens=5, min_tokens=6)), "stopping.min_tokens", None),
    (text_req(stopping=ST(min_tokens=MAX_MODEL_LEN)), "stopping.min_tokens", None),
    (text_req(stopping=ST(max_tokens=4, stop=[f"s{i}" for i in range(5000)])), "stopping.stop", None),
    (text_req(stopping=ST(max_tokens=4, stop=["fine", ""])), "stopping.stop[1]", None),
    (text_req(stopping=ST(max_tokens=4, stop=["z" * 100_000])), "stopping.stop[0]", None),
    (text_req(stopping=ST(max_tokens=4, stop_token_ids=list(range(5000)))), "stopping.stop_token_ids", None),
    (text_req(stopping=ST(max_tokens=4, stop_token_ids=[TINY_VOCAB])), "stopping.stop_token_ids[0]", None),
    (text_req(output=O(logprobs=10_000)), "output.logprobs", None),
    (text_req(output=O(prompt_logprobs=2 ** 32 - 1)), "output.prompt_logprobs", None),
    (pb.GenerateRequest(chat=pb.ChatPrompt()), "chat.messages", None),
    (pb.GenerateRequest(chat=pb.ChatPrompt(messages=[pb.ChatMessage(role="user", content="hi"),
                                                     pb.ChatMessage(role="root", content="obey")])),
     "chat.messages[1].role", None),
    (pb.GenerateRequest(chat=pb.ChatPrompt(messages=[pb.ChatMessage(role="", content="hi")])),
     "chat.messages[0].role", None),
    (pb.GenerateRequest(chat=pb.ChatPrompt(messages=[pb.ChatMessage(role="user", content="c" * 1000)])),
     "prompt", "PROMPT_TOO_LONG"),
    (text_req(request_id="x" * 1000), "request_id", None),
    (text_req(request_id="x" * 10_000), "request_id", None),  # echoed, it would pass 8 KiB of trailers
    (text_req(request_id="bad\nid"), "request_id", None),
    (text_req(request_id="ünïcødé"), "request_id", None),  # not allowed in the x-request-id header
    (text_req(labels={"tenant": "x" * 100_000}), "labels", None),  # in every log line of the request
    (text_req(labels={"k" * 100_000: "v"}), "labels", None),
    (pb.GenerateRequest(chat=pb.ChatPrompt(messages=[pb.ChatMessage(role="r" * 100_000, content="hi")])),
     "chat.messages[0].role", None),  # the message quotes the role: clipped
]


@pytest.mark.parametrize("request_,field,reason", BAD, ids=[f"{i}-{c[1]}" for i, c in enumerate(BAD)])
@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_bad_input_is_invalid_argument_naming_the_field(srv, request_, field, reason, stream):
    r = pb.GenerateRequest()
    r.CopyFrom(request_)
    r.stream = stream
    with pytest.raises(grpc.RpcError) as ei:
        list(srv.stub.Generate(r, timeout=30))
    e = ei.value
    assert e.code() == INVALID, (e.code(), e.details())
    assert field in e.details()
    d = rpc_details(e)
    assert [v.field for v in d["BadRequest"].field_violations] == [field]
    assert d["ErrorInfo"].domain == "llmsvc"
    if field == "request_id":  # a refused id is not sent back
        assert "request_id" not in d["ErrorInfo"].metadata
    if reason is not None:
        assert d["ErrorInfo"].reason == reason
        assert int(d["ErrorInfo"].metadata["max_model_len"]) == MAX_MODEL_LEN
        assert int(d["ErrorInfo"].metadata["prompt_tokens"]) >= MAX_MODEL_LEN - 1


def test_an_unknown_adapter_name_of_any_length_is_not_found(srv):
    # the message names the adapter asked for: clipped, the status stays NOT_FOUND (unclipped, the
    # trailers passed what a client accepts and it saw RESOURCE_EXHAUSTED)
    for name in ("nope", "L" * 100_000):
        with pytest.raises(grpc.RpcError) as ei:
            list(srv.stub.Generate(text_req(lora_name=name), timeout=30))
        assert ei.value.code() == grpc.StatusCode.NOT_FOUND, (ei.value.code(), ei.value.details()[:100])
        assert name[:100] in ei.value.details() and len(ei.value.details()) <= 1024


def test_negative_token_ids_cannot_be_encoded():
    # TokenIds.ids is uint32: a negative id never reaches the server, the client library refuses it
    with pytest.raises(ValueError):
        pb.TokenIds(ids=[1, -1])


def test_truncation_serves_an_over_long_prompt(srv):
    (m,) = list(srv.stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[7] * 1000), truncate_prompt_tokens=200,
                                                     sampling=GREEDY, stopping=ST(max_tokens=8, ignore_eos=True)),
                                  timeout=60))
    assert m.prompt.num_prompt_tokens == 200 and len(m.token_ids) == 8
    assert m.finish.reason == pb.FinishInfo.REASON_LENGTH


def test_prompt_logprobs_survive_preemption(srv):
    # found by the fuzzer: n=2 filling the context overflows the 24-block pool, a child is preempted and
    # recomputes its prompt; the prompt logprobs were reported twice and the engine loop died
    prompt = list(range(40, 52))
    base = dict(token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParams(temperature=0.0, n=2),
                output=O(prompt_logprobs=1))
    msgs = list(srv.stub.Generate(pb.GenerateRequest(stopping=ST(ignore_eos=True), **base), timeout=120))
    (alone,) = [m for m in srv.stub.Generate(pb.GenerateRequest(stopping=ST(max_tokens=1), **base), timeout=60)
                if m.HasField("prompt")]
    assert srv.server.async_engine.get_stats().num_preemptions > 0
    (first,) = [m for m in msgs if m.HasField("prompt")]
    assert len(first.prompt.logprobs) == len(prompt) == len(alone.prompt.logprobs)
    assert_logprobs_close([(lp.token_id, lp.logprob) for lp in first.prompt.logprobs],
                          [(lp.token_id, lp.logprob) for lp in alone.prompt.logprobs], "prompt logprobs")
    finals = [m for m in msgs if m.HasField("finish")]
    assert sorted(m.finish.reason for m in finals) == [pb.FinishInfo.REASON_CONTEXT] * 2


@pytest.mark.parametrize("stream", [True, False])
def test_prompt_logprobs_of_a_prompt_longer_than_one_step(srv, stream):
    # 200 prompt tokens under a 128-token budget: two prefill chunks. Only the first chunk's
    # positions used to reach the client (its PromptInfo went out before the second chunk ran)
    import torch

    from tests.model_utils import load_hf_model
    prompt = [(7 * i + 3) % TINY_VOCAB for i in range(200)]
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), stream=stream, sampling=GREEDY,
                             stopping=ST(max_tokens=3, ignore_eos=True), output=O(prompt_logprobs=2))
    msgs = list(srv.stub.Generate(req, timeout=60))
    (info,) = [m.prompt for m in msgs if m.HasField("prompt")]
    assert msgs[0].HasField("prompt") and msgs[0].token_ids  # sent once, with the first token
    assert info.num_prompt_tokens == 200 and [lp.token_id for lp in info.logprobs] == prompt
    assert not info.logprobs[0].HasField("logprob") and all(lp.HasField("logprob") for lp in info.logprobs[1:])
    with torch.no_grad():
        ref = torch.log_softmax(load_hf_model(srv.model_dir)(torch.tensor([prompt])).logits[0].float(), -1)
    got = torch.tensor([lp.logprob for lp in info.logprobs[1:]])
    assert torch.allclose(got, ref[torch.arange(199), torch.tensor(prompt[1:])], atol=1e-4)
    for pos in (1, 128, 199):  # either side of the chunk border
        top = info.logprobs[pos].top_logprobs
        assert [t.token_id for t in top] == ref[pos - 1].topk(2).indices.tolist()


@pytest.mark.parametrize("prompt", [[19], [19, 23]])
def test_prompt_logprobs_cover_every_prompt_position(srv, prompt):
    # a one-token prompt got no entry at all; vLLM gives [None]: one entry, without a logprob
    (m,) = list(srv.stub.Generate(pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=prompt), sampling=GREEDY, stopping=ST(max_tokens=2, ignore_eos=True),
        output=O(prompt_logprobs=1)), timeout=60))
    assert [lp.token_id for lp in m.prompt.logprobs] == prompt
    assert [lp.HasField("logprob") for lp in m.prompt.logprobs] == [False] + [True] * (len(prompt) - 1)


def test_oversized_message_is_resource_exhausted(srv):
    big = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[2 ** 31] * (17 << 20)))  # 5 bytes/id: ~85 MiB
    assert big.ByteSize() > 64 << 20
    with pytest.raises(grpc.RpcError) as ei:
        list(srv.stub.Generate(big, timeout=60))
    assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_large_but_allowed_message_is_refused_cleanly(srv):
    # 2M token ids (~6 MiB, under the receive limit): validated and refused, the server stays responsive
    r = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[9] * (2 << 20)))
    with pytest.raises(grpc.RpcError) as ei:
        list(srv.stub.Generate(r, timeout=60))
    assert ei.value.code() == INVALID and rpc_details(ei.value)["ErrorInfo"].reason == "PROMPT_TOO_LONG"


class _SignallingTokenizer:
    """Delegates to the server's tokenizer; sets `started` when a big text starts being tokenized."""

    def __init__(self, inner) -> None:
        self._inner, self.started = inner, threading.Event()

    def __call__(self, text, *a, **kw):
        if isinstance(text, str) and len(text) > 1 << 20:
            self.started.set()
        return self._inner(text, *a, **kw)

    def __getattr__(self, name):
        return getattr(self._inner, name)


def test_huge_text_prompt_does_not_stall_other_streams(srv, monkeypatch):
    # tokenizing 2 MiB of text takes seconds: it must run off the event loop (a witness completes meanwhile)
    witness = Witness(srv, 2, max_tokens=30)
    tok = _SignallingTokenizer(srv.server.servicer.tokenizer)
    monkeypatch.setattr(srv.server.servicer, "tokenizer", tok)
    result = {}

    def big():
        try:
            list(srv.stub.Generate(pb.GenerateRequest(text="ab" * (1 << 20)), timeout=120))
        except grpc.RpcError as e:
            result["code"], result["witness_done"] = e.code(), witness.finish is not None

    t = threading.Thread(target=big)
    t.start()
    assert tok.started.wait(60)
    witness.start()
    witness.check()
    t.join(120)
    assert result == {"code": INVALID, "witness_done": True}


def test_tokenize_offsets_of_a_large_multibyte_text(srv):
    small = "héllo wörld ✓ 🙂 ok"
    r = srv.stub.Tokenize(pb.TokenizeRequest(text=small, return_offsets=True), timeout=30)
    enc = srv.server.servicer.tokenizer(small, add_special_tokens=True, return_offsets_mapping=True)
    want = [(len(small[:a].encode()), len(small[:b].encode())) for a, b in enc["offset_mapping"]]
    assert [(o.start, o.end) for o in r.offsets] == want and len(want) == len(r.token_ids)
    big = "ünïcödé ✓ " * 20_000  # 200k characters: offsets must be computed in linear time, off the loop
    r = srv.stub.Tokenize(pb.TokenizeRequest(text=big, return_offsets=True), timeout=60)
    enc = srv.server.servicer.tokenizer(big, add_special_tokens=True, return_offsets_mapping=True)
    cum = [0, *itertools.accumulate(len(c.encode()) for c in big)]  # byte offset of each character
    assert [(o.start, o.end) for o in r.offsets] == [(cum[a], cum[b]) for a, b in enc["offset_mapping"]]
    assert r.offsets[-1].end == len(big.encode())


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def test_unknown_fields_from_a_newer_client_are_ignored(srv):
    known = pb.GenerateRequest(text="forward compatible", sampling=GREEDY, stopping=ST(max_tokens=6, ignore_eos=True))
    # field 1000 varint, field 1001 length-delimited, and an unknown field inside `sampling` (number 99)
    extra = _varint(1000 << 3 | 0) + _varint(42) + _varint(1001 << 3 | 2) + _varint(5) + b"hello"
    sampling_extra = _varint(99 << 3 | 0) + _varint(7)
    raw = known.SerializeToString() + extra + _varint(6 << 3 | 2) + _varint(len(sampling_extra)) + sampling_extra
    call = srv.channel.unary_stream("/llmsvc.v1.LlmService/Generate", request_serializer=lambda b: b,
                                    response_deserializer=pb.GenerateResponse.FromString)
    (got,) = list(call(raw, timeout=60))
    (want,) = list(srv.stub.Generate(known, timeout=60))
    assert list(got.token_ids) == list(want.token_ids) and len(got.token_ids) == 6
    assert got.text == want.text and got.finish.reason == pb.FinishInfo.REASON_LENGTH


def test_garbage_bytes_are_rejected_not_crashing(srv):
    call = srv.channel.unary_stream("/llmsvc.v1.LlmService/Generate", request_serializer=lambda b: b,
                                    response_deserializer=pb.GenerateResponse.FromString)
    with pytest.raises(grpc.RpcError) as ei:
        list(call(b"\xff\xff\xff\xff\x0f\x12\x80", timeout=30))
    assert ei.value.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.INVALID_ARGUMENT,
                               grpc.StatusCode.UNKNOWN)  # grpc's own deserialisation failure status


# ---- property-based fuzzing ---------------------------------------------------------------
# Each field is usually unset or sane and sometimes (1 in 12) anything its type can hold, so that
# about half the requests are served and the rest probe one or two rules at a time.
wild_floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=32), st.sampled_from([1e-30, -0.0]))
u32 = st.integers(0, 2 ** 32 - 1)
texts = st.text(st.characters(codec="utf-8"), max_size=80)
SANE_FLOATS = {"temperature": st.floats(0, 2), "top_p": st.floats(0.05, 1), "min_p": st.floats(0, 1),
               "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
               "repetition_penalty": st.floats(0.5, 2)}


@st.composite
def generate_requests(draw) -> pb.GenerateRequest:
    def choose(sane, wild):  # a strategy
        return wild if draw(st.integers(0, 11)) == 7 else sane  # not 0: hypothesis favours bounds

    def pick(sane, wild):  # a value
        return draw(choose(sane, wild))

    def maybe() -> bool:
        return draw(st.booleans())
    r = pb.GenerateRequest()
    if maybe():
        r.request_id = pick(st.text("abcdef0123456789-", max_size=40), st.text(max_size=300))
    kind = pick(st.sampled_from(["text", "token_ids", "chat"]), st.just("none"))
    if kind == "text":
        r.text = pick(texts, st.text(max_size=600))
    elif kind == "token_ids":
        r.token_ids.ids.extend(draw(st.lists(choose(st.integers(0, TINY_VOCAB - 1), u32), max_size=300)))
    elif kind == "chat":
        roles = pick(st.sampled_from(["user", "assistant", "system"]), st.sampled_from(["tool", "??", "", "User"]))
        for content in draw(st.lists(texts, max_size=4)):
            r.chat.messages.add(role=roles, content=content)
        if maybe():
            r.chat.add_generation_prompt = maybe()
    if maybe():
        r.add_special_tokens = maybe()
    s = r.sampling
    for name, sane in SANE_FLOATS.items():
        if maybe():
            setattr(s, name, pick(sane, wild_floats))
    if maybe():
        s.top_k = pick(st.integers(-1, 50), st.integers(-2 ** 31, 2 ** 31 - 1))
    if maybe():
        s.seed = pick(st.integers(0, 2 ** 32), st.integers(0, 2 ** 64 - 1))
    if maybe():
        s.n = pick(st.integers(1, 3), u32)
    for tok, b in draw(st.dictionaries(choose(st.integers(0, TINY_VOCAB - 1), u32),
                                       choose(st.floats(-100, 100), wild_floats), max_size=2)).items():
        s.logit_bias[tok] = b
    if draw(st.integers(0, 19)) == 7:
        s.json_schema = draw(texts)
    t = r.stopping
    if draw(st.integers(0, 7)) > 0:  # mostly short generations: the fuzzer must stay fast
        t.max_tokens = pick(st.integers(1, 8), u32)
    if maybe():
        t.min_tokens = pick(st.integers(0, 4), u32)
    t.stop.extend(draw(st.lists(choose(st.text(min_size=1, max_size=4), st.text(max_size=2000)), max_size=4)))
    t.stop_token_ids.extend(draw(st.lists(choose(st.integers(0, TINY_VOCAB - 1), u32), max_size=3)))
    t.include_stop_str_in_output, t.ignore_eos = maybe(), maybe()
    if maybe():
        t.time_limit_ms = draw(st.integers(1, 200))
    o = r.output
    for name in ("text", "token_ids", "skip_special_tokens", "spaces_between_special_tokens"):
        if maybe():
            setattr(o, name, maybe())
    for name in ("logprobs", "prompt_logprobs"):
        if maybe():
            setattr(o, name, pick(st.integers(0, 3), u32))
    o.prompt_token_ids, o.token_text, o.include_timing = maybe(), maybe(), maybe()
    r.stream = maybe()
    r.priority = pick(st.integers(-3, 3), st.integers(-2 ** 31, 2 ** 31 - 1))
    if maybe():
        r.truncate_prompt_tokens = pick(st.integers(1, 255), u32)
    for k, v in draw(st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=3)).items():
        r.labels[k] = v
    return r


ALLOWED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.FAILED_PRECONDITION,
           grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.ALREADY_EXISTS}


@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(r=generate_requests())
def _fuzz_all(srv, r):
    _fuzz_one(srv, r)


def test_fuzz_generate_never_internal(srv):
    witness = Witness(srv, 1, max_tokens=60).start()
    _fuzz_all(srv)  # 150 examples while the witness streams
    witness.check()
    assert_invariants(srv)


def _fuzz_one(srv, r):
    try:
        msgs = list(srv.stub.Generate(r, timeout=20))
    except grpc.RpcError as e:
        assert e.code() in ALLOWED, (e.code(), e.details(), r)
        if e.code() == INVALID:
            assert rpc_details(e)["BadRequest"].field_violations[0].field
        return
    finals = [m for m in msgs if m.HasField("finish")]
    assert msgs and msgs[0].request_id and len(finals) == max(1, r.sampling.n)
    assert all(m.finish.reason != pb.FinishInfo.REASON_UNSPECIFIED for m in finals)


def test_a_kv_pool_smaller_than_the_context_is_the_limit_reported_and_enforced(tmp_path_factory):
    # 8 blocks of 16 tokens: requests are held to 128 tokens, not the model's 256. GetModelInfo
    # and Tokenize said 256 while refusals named 128, so a client sizing max_tokens from them failed
    s = live_server(tiny_model_dir(tmp_path_factory), config_kw={"num_blocks": 8})
    try:
        assert s.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10).max_model_len == 128
        assert s.stub.Tokenize(pb.TokenizeRequest(text="hi"), timeout=10).max_model_len == 128
        with pytest.raises(grpc.RpcError) as ei:
            list(s.stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5] * 128)), timeout=30))
        info = rpc_details(ei.value)["ErrorInfo"]
        assert info.reason == "PROMPT_TOO_LONG" and info.metadata["max_model_len"] == "128"
        assert "KV cache" in ei.value.details()
        with pytest.raises(grpc.RpcError) as ei:
            list(s.stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5] * 100),
                                                    stopping=ST(max_tokens=40)), timeout=30))
        assert ei.value.code() == INVALID and "(128)" in ei.value.details()
        (m,) = [m for m in s.stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5] * 100), sampling=GREEDY,
                                                              stopping=ST(max_tokens=28, ignore_eos=True)),
                                           timeout=60) if m.HasField("finish")]
        assert m.finish.reason == pb.FinishInfo.REASON_LENGTH and m.num_output_tokens == 28
    finally:
        s.stop()
