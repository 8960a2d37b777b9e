"""LlmServer over a real loopback port, real LLMEngine on the FakeExecutor (no model compute).

Covers the stream shape, request ids, cancel/abort/deadline freeing KV blocks, every error row
of docs/api.md's error table, health Watch across startup, reflection v1/v1alpha, and graceful shutdown.
"""
from __future__ import annotations

import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmsvc.v1 import llmsvc_pb2 as pb
from tests.reliability_utils import rpc_details
from tests.server_harness import EOS, ServerThread, fake_engine_factory

SERVICE = "llmsvc.v1.LlmService"
ST = pb.StoppingCriteria


@pytest.fixture(scope="module")
def srv():
    s = ServerThread(fake_engine_factory(num_blocks=64, step_delay=0.003, max_model_len=256))
    yield s
    s.stop()


def gen(text="hello", max_tokens=8, **kw) -> pb.GenerateRequest:
    return pb.GenerateRequest(text=text, stopping=ST(max_tokens=max_tokens), **kw)


def free_blocks_back(s: ServerThread, timeout: float = 10.0) -> pb.GetServerInfoResponse:
    end = time.monotonic() + timeout
    while True:
        info = s.stub.GetServerInfo(pb.GetServerInfoRequest())
        if info.num_free_kv_blocks == info.num_kv_blocks and info.num_running == 0 and info.num_waiting == 0:
            return info
        assert time.monotonic() < end, f"KV blocks not returned: {info}"
        time.sleep(0.02)


details = rpc_details  # google.rpc details of a failed call by type name


def test_stream_deltas_concatenate_to_unary_text(srv):
    msgs = list(srv.stub.Generate(gen(max_tokens=20, stream=True)))
    (final,) = list(srv.stub.Generate(gen(max_tokens=20)))
    assert "".join(m.text for m in msgs) == final.text and len(final.text) == 20
    assert [t for m in msgs for t in m.token_ids] == list(final.token_ids)
    assert msgs[0].HasField("prompt") and msgs[0].prompt.num_prompt_tokens == 5
    assert all(not m.HasField("prompt") for m in msgs[1:])
    assert [m.HasField("finish") for m in msgs] == [False] * (len(msgs) - 1) + [True]
    assert final.finish.reason == pb.FinishInfo.REASON_LENGTH
    assert final.finish.usage.prompt_tokens == 5 and final.finish.usage.completion_tokens == 20
    assert msgs[-1].num_output_tokens == 20
    assert len({m.request_id for m in msgs}) == 1 and msgs[0].request_id


def _streamed_counts(stub, interval=None):
    output = pb.OutputOptions(stream_interval=interval) if interval else None
    msgs = list(stub.Generate(gen(max_tokens=19, stream=True, output=output)))
    (final,) = list(stub.Generate(gen(max_tokens=19)))
    assert "".join(m.text for m in msgs) == final.text and [t for m in msgs for t in m.token_ids] == list(final.token_ids)
    assert msgs[-1].HasField("finish") and not any(m.HasField("finish") for m in msgs[:-1])
    return [m.num_output_tokens for m in msgs]


def test_stream_interval_per_request_and_server_floor(srv):
    # a reader slower than the engine merges messages, so counts are checked, not message sizes:
    # every message but the last ends on the first token or on a multiple of the interval after it
    counts = _streamed_counts(srv.stub, interval=4)
    assert counts[-1] == 19 and set(counts[:-1]) <= {1, 5, 9, 13, 17} and len(counts) <= 6
    with ServerThread(fake_engine_factory(num_blocks=64, step_delay=0.003, stream_interval=3)) as s:
        counts = _streamed_counts(s.stub)  # the server's --stream-interval
        assert counts[-1] == 19 and set(counts[:-1]) <= {1, 4, 7, 10, 13, 16}
        counts = _streamed_counts(s.stub, interval=2)  # a request may not go below it
        assert set(counts[:-1]) <= {1, 4, 7, 10, 13, 16}
        free_blocks_back(s)


def test_n_outputs_each_finish_once(srv):
    msgs = list(srv.stub.Generate(gen(max_tokens=6, stream=True, sampling=pb.SamplingParams(n=3, seed=1))))
    for i in range(3):
        mine = [m for m in msgs if m.index == i]
        assert sum(m.HasField("finish") for m in mine) == 1 and mine[-1].HasField("finish")
        assert sum(len(m.token_ids) for m in mine) == 6
    unary = list(srv.stub.Generate(gen(max_tokens=6, sampling=pb.SamplingParams(n=3))))
    assert sorted(m.index for m in unary) == [0, 1, 2] and unary[0].HasField("prompt")


def test_unset_max_tokens_fills_context(srv):
    (final,) = list(srv.stub.Generate(pb.GenerateRequest(text="x" * 200)))
    assert final.finish.reason == pb.FinishInfo.REASON_CONTEXT and len(final.token_ids) == 56


def test_request_id_body_metadata_and_generated(srv):
    call = srv.stub.Generate(gen(request_id="body-id", stream=True))
    assert dict(call.initial_metadata())["x-request-id"] == "body-id"
    assert {m.request_id for m in call} == {"body-id"}
    call = srv.stub.Generate(gen(stream=True), metadata=(("x-request-id", "md-id"),))
    assert dict(call.initial_metadata())["x-request-id"] == "md-id"
    assert {m.request_id for m in call} == {"md-id"}
    call = srv.stub.Generate(gen())
    rid = dict(call.initial_metadata())["x-request-id"]
    assert len(rid) == 32 and [m.request_id for m in call] == [rid]


def test_first_message_before_last_token_and_metadata_before_prefill(srv):
    call = srv.stub.Generate(gen(max_tokens=150, stream=True))
    rid = dict(call.initial_metadata())["x-request-id"]  # sent at admission
    first = next(call)
    assert first.request_id == rid and not first.HasField("finish") and len(first.token_ids) < 150
    rest = list(call)
    assert rest[-1].finish.reason == pb.FinishInfo.REASON_LENGTH


def test_concurrent_streams_all_complete(srv):
    (expected,) = list(srv.stub.Generate(gen(text="same prompt", max_tokens=12)))
    results = [None] * 16

    def worker(i):
        results[i] = "".join(m.text for m in srv.stub.Generate(gen(text="same prompt", max_tokens=12, stream=True)))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == [expected.text] * 16
    free_blocks_back(srv)


def test_cancel_mid_stream_frees_blocks(srv):
    call = srv.stub.Generate(gen(max_tokens=200, stream=True, request_id="to-cancel"))
    next(call)
    info = srv.stub.GetServerInfo(pb.GetServerInfoRequest())
    assert info.num_free_kv_blocks < info.num_kv_blocks
    call.cancel()
    free_blocks_back(srv)
    assert not srv.engine.has_unfinished_requests()
    assert list(srv.stub.Generate(gen(request_id="to-cancel")))  # id released after the abort


def test_abort_takes_at_most_as_many_ids_as_the_server_holds_requests(srv):
    # fake_engine_factory: 8 running + 4096 waiting; a million ids once stalled every stream
    assert list(srv.stub.Abort(pb.AbortRequest(request_ids=["nope"] * 4104)).not_found) == ["nope"] * 4104
    with pytest.raises(grpc.RpcError) as ei:
        srv.stub.Abort(pb.AbortRequest(request_ids=["nope"] * 4105))
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "at most 4104 ids" in ei.value.details()


def test_abort_rpc_ends_ok_with_partial_output(srv):
    call = srv.stub.Generate(gen(max_tokens=200, stream=True, request_id="to-abort"))
    first = next(call)
    # a reason every aborted stream would carry back is bounded: refused, nothing aborted
    for bad in ("x" * 5_000_000, "two\nlines"):
        with pytest.raises(grpc.RpcError) as ei:
            srv.stub.Abort(pb.AbortRequest(request_ids=["to-abort"], reason=bad))
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "reason" in ei.value.details()
        assert len(ei.value.details()) < 200
    resp = srv.stub.Abort(pb.AbortRequest(request_ids=["to-abort", "unknown"], reason="user stop"))
    assert list(resp.aborted) == ["to-abort"] and list(resp.not_found) == ["unknown"]
    rest = list(call)  # ends with status OK
    assert call.code() == grpc.StatusCode.OK
    final = rest[-1]
    assert final.finish.reason == pb.FinishInfo.REASON_ABORTED and final.finish.abort_reason == "user stop"
    total = len(first.token_ids) + sum(len(m.token_ids) for m in rest)
    assert 0 < total < 200 and final.num_output_tokens == total
    free_blocks_back(srv)
    assert list(srv.stub.Abort(pb.AbortRequest(request_ids=["to-abort"])).not_found) == ["to-abort"]


def test_deadline_expiry_aborts_and_frees(srv):
    with pytest.raises(grpc.RpcError) as ei:
        list(srv.stub.Generate(gen(max_tokens=200, stream=True), timeout=0.2))
    assert ei.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    free_blocks_back(srv)


def test_duplicate_in_flight_id(srv):
    call = srv.stub.Generate(gen(max_tokens=200, stream=True, request_id="dup"))
    next(call)
    with pytest.raises(grpc.RpcError) as ei:
        list(srv.stub.Generate(gen(request_id="dup")))
    assert ei.value.code() == grpc.StatusCode.ALREADY_EXISTS
    call.cancel()
    free_blocks_back(srv)


@pytest.mark.parametrize("first,second,message", [
    (("foo", 2), ("0_foo", 1), "request id '0_foo' is the id of a sample of request 'foo', in flight"),
    (("1_bar", 1), ("bar", 2), "request id 'bar' would give sample 1 the id '1_bar', which request '1_bar' "
                               "in flight holds")])
def test_id_of_another_requests_sample_is_taken(srv, first, second, message):
    # a request with n=2 runs as samples "0_<id>" and "1_<id>" in the engine core: a second
    # request with such an id (or whose samples would take one) used to end the core, server and all
    (id1, n1), (id2, n2) = first, second
    call = srv.stub.Generate(gen(max_tokens=60, stream=True, request_id=id1, sampling=pb.SamplingParams(n=n1)))
    next(call)
    with pytest.raises(grpc.RpcError) as ei:
        list(srv.stub.Generate(gen(request_id=id2, sampling=pb.SamplingParams(n=n2))))
    assert (ei.value.code(), ei.value.details()) == (grpc.StatusCode.ALREADY_EXISTS, message)
    finals = [m for m in call if m.HasField("finish")]
    assert [m.finish.reason for m in finals] == [pb.FinishInfo.REASON_LENGTH] * n1  # the first one unharmed
    assert [m.finish.reason for m in srv.stub.Generate(gen(request_id=id2, sampling=pb.SamplingParams(n=n2)))
            if m.HasField("finish")] == [pb.FinishInfo.REASON_LENGTH] * n2  # and the id is free afterwards
    free_blocks_back(srv)


@pytest.mark.parametrize("request_,code,field", [
    (gen(sampling=pb.SamplingParams(top_p=0.0)), grpc.StatusCode.INVALID_ARGUMENT, "sampling.top_p"),
    (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 5000])), grpc.StatusCode.INVALID_ARGUMENT,
     "token_ids.ids[1]"),
    (pb.GenerateRequest(text="z" * 300), grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
    (gen(sampling=pb.SamplingParams(json_schema="{")), grpc.StatusCode.INVALID_ARGUMENT, "sampling.json_schema"),
])
def test_error_rows_over_the_wire(srv, request_, code, field):
    with pytest.raises(grpc.RpcError) as ei:
        list(srv.stub.Generate(request_))
    assert ei.value.code() == code
    if field:
        d = details(ei.value)
        assert d["BadRequest"].field_violations[0].field == field and field in ei.value.details()
        assert d["ErrorInfo"].domain == "llmsvc"
        if field == "prompt":
            assert d["ErrorInfo"].reason == "PROMPT_TOO_LONG"
            assert d["ErrorInfo"].metadata["prompt_tokens"] == "300"


def test_deadline_already_expired_at_admission(srv):
    # a deadline that passes while the request sits in the client: the server never starts it
    with pytest.raises(grpc.RpcError) as ei:
        list(srv.stub.Generate(gen(), timeout=0.000001))
    assert ei.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


def test_internal_error_hides_stack_trace(srv, monkeypatch):
    def boom(*a, **k):
        raise RuntimeError("secret detail")
    monkeypatch.setattr(srv.server.servicer, "tokenizer", boom)
    with pytest.raises(grpc.RpcError) as ei:
        list(srv.stub.Generate(gen(request_id="int-1")))
    assert ei.value.code() == grpc.StatusCode.INTERNAL
    assert "secret" not in ei.value.details() and "Traceback" not in ei.value.details()
    assert details(ei.value)["ErrorInfo"].metadata["request_id"] == "int-1"


def test_tokenize_detokenize_model_info(srv):
    t = srv.stub.Tokenize(pb.TokenizeRequest(text="héllo", return_offsets=True, return_pieces=True))
    assert list(t.token_ids) == list("héllo".encode()) and t.max_model_len == 256
    offs = [(o.start, o.end) for o in t.offsets]  # UTF-8 byte offsets
    assert len(offs) == 6 and offs[0] == (0, 1) and offs[-1] == (5, 6)
    assert len(t.pieces) == 6
    assert srv.stub.Detokenize(pb.DetokenizeRequest(token_ids=t.token_ids)).text == "héllo"
    with pytest.raises(grpc.RpcError) as ei:
        srv.stub.Detokenize(pb.DetokenizeRequest(token_ids=[99999]))
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    chat = pb.ChatPrompt(messages=[pb.ChatMessage(role="user", content="hi")])
    ids = srv.stub.Tokenize(pb.TokenizeRequest(chat=chat)).token_ids
    assert srv.stub.Detokenize(pb.DetokenizeRequest(token_ids=ids, skip_special_tokens=False)).text.startswith(
        "<|im_start|>user\nhi")
    info = srv.stub.GetModelInfo(pb.GetModelInfoRequest())
    assert info.max_model_len == 256 and info.vocab_size == 259 and list(info.eos_token_ids) == [EOS]
    assert info.has_chat_template
    assert sorted(info.supported_constraints) == ["choice", "grammar", "json_object", "json_schema", "regex"]
    assert info.default_sampling.temperature == 1.0 and info.default_sampling.n == 1


def test_unset_max_tokens_takes_generation_configs_max_new_tokens():
    # as vLLM: generation_config's max_new_tokens caps a request that sets no max_tokens (where
    # the prompt leaves room for it); GetModelInfo shows it in default_stopping
    base = fake_engine_factory()

    def make():
        engine = base()
        engine.config.model_config.generation_defaults = {"max_tokens": 3}
        return engine
    s = ServerThread(make)
    try:
        assert s.stub.GetModelInfo(pb.GetModelInfoRequest()).default_stopping.max_tokens == 3

        def finish(**kw):
            (m,) = list(s.stub.Generate(pb.GenerateRequest(text="hello", **kw)))
            return len(m.token_ids), m.finish.reason
        assert finish() == (3, pb.FinishInfo.REASON_LENGTH)
        assert finish(stopping=ST(max_tokens=5)) == (5, pb.FinishInfo.REASON_LENGTH)
        assert finish(stopping=ST(min_tokens=4)) == (4, pb.FinishInfo.REASON_LENGTH)
        (m,) = list(s.stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5] * 253))))  # room for 3 exactly
        assert (len(m.token_ids), m.finish.reason) == (3, pb.FinishInfo.REASON_LENGTH)
        (m,) = list(s.stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5] * 254))))  # no room for 3: to the end
        assert (len(m.token_ids), m.finish.reason) == (2, pb.FinishInfo.REASON_CONTEXT)
    finally:
        s.stop()


def test_chat_generate(srv):
    chat = pb.ChatPrompt(messages=[pb.ChatMessage(role="user", content="hi")])
    (m,) = list(srv.stub.Generate(pb.GenerateRequest(chat=chat, stopping=ST(max_tokens=3),
                                                     output=pb.OutputOptions(prompt_token_ids=True))))
    assert m.prompt.num_prompt_tokens == 21 and list(m.prompt.token_ids)[0] == 257 and len(m.text) == 3


def test_logprobs_and_options(srv):
    (m,) = list(srv.stub.Generate(gen(max_tokens=4, output=pb.OutputOptions(
        logprobs=1, token_text=True, text=False, include_timing=True))))
    assert m.text == "" and len(m.token_ids) == 4 and len(m.logprobs) == 4
    assert all(lp.token_id == t and lp.rank >= 1 and len(lp.top_logprobs) == 1
               for lp, t in zip(m.logprobs, m.token_ids))
    assert m.logprobs[0].token_bytes == bytes([m.token_ids[0]])
    assert m.finish.timing.total.ToNanoseconds() > 0


def test_health_reflection_names(srv):
    h = health_pb2_grpc.HealthStub(srv.channel)
    for name in ("", SERVICE):
        assert h.Check(health_pb2.HealthCheckRequest(service=name)).status == health_pb2.HealthCheckResponse.SERVING


def test_health_check_of_an_unknown_service_names_the_known_ones(srv):
    h = health_pb2_grpc.HealthStub(srv.channel)
    with pytest.raises(grpc.RpcError) as ei:
        h.Check(health_pb2.HealthCheckRequest(service="nope"))
    assert ei.value.code() == grpc.StatusCode.NOT_FOUND
    assert ei.value.details() == f"unknown service 'nope'; known: '', {SERVICE!r}, 'vllm.grpc.engine.VllmEngine'"


def test_health_list_gives_every_known_service(srv):
    h = health_pb2_grpc.HealthStub(srv.channel)
    resp = h.List(health_pb2.HealthListRequest())
    assert {name: st.status for name, st in resp.statuses.items()} == {
        "": health_pb2.HealthCheckResponse.SERVING, SERVICE: health_pb2.HealthCheckResponse.SERVING,
        "vllm.grpc.engine.VllmEngine": health_pb2.HealthCheckResponse.SERVING}


def test_every_listed_service_resolves_by_reflection(srv):
    """grpcurl's `describe` resolves each listed service and stops at the first it cannot."""
    from google.protobuf import descriptor_pool
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    channel = grpc.insecure_channel(srv.address)
    try:
        names = ProtoReflectionDescriptorDatabase(channel).get_services()
        assert "grpc.reflection.v1.ServerReflection" in names
        for name in names:  # a fresh pool each, so no file resolves from another's lookups
            pool = descriptor_pool.DescriptorPool(ProtoReflectionDescriptorDatabase(channel))
            service = pool.FindServiceByName(name)
            assert service.methods and all(m.input_type.full_name and m.output_type.full_name
                                           for m in service.methods), name
    finally:
        channel.close()


def _list_services(channel, version: str) -> list[str]:
    from grpc_reflection.v1alpha import reflection_pb2
    call = channel.stream_stream(f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo",
                                 request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                                 response_deserializer=reflection_pb2.ServerReflectionResponse.FromString)
    (resp,) = list(call(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    return [s.name for s in resp.list_services_response.service]


def test_reflection_only_client_streams_a_completion(srv):
    from google.protobuf import descriptor_pool, message_factory
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    channel = grpc.insecure_channel(srv.address)
    try:
        db = ProtoReflectionDescriptorDatabase(channel)
        assert SERVICE in db.get_services()
        pool = descriptor_pool.DescriptorPool(db)
        method = pool.FindServiceByName(SERVICE).FindMethodByName("Generate")
        Req = message_factory.GetMessageClass(method.input_type)
        Resp = message_factory.GetMessageClass(method.output_type)
        request = Req()
        request.text = "hello"
        request.stream = True
        request.stopping.max_tokens = 5
        call = channel.unary_stream(f"/{SERVICE}/Generate", request_serializer=Req.SerializeToString,
                                    response_deserializer=Resp.FromString)
        msgs = list(call(request))
        assert len("".join(m.text for m in msgs)) == 5 and msgs[-1].HasField("finish")
        for version in ("v1", "v1alpha"):
            assert {SERVICE, "llmsvc.v1.AdminService", "grpc.health.v1.Health"} <= set(_list_services(channel, version))
    finally:
        channel.close()


def test_health_watch_not_serving_to_serving_across_startup():
    s = ServerThread(fake_engine_factory(), load=False)
    try:
        h = health_pb2_grpc.HealthStub(s.channel)
        watch = h.Watch(health_pb2.HealthCheckRequest(service=SERVICE))
        assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
        assert h.Check(health_pb2.HealthCheckRequest(service="")).status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as ei:  # model loading: UNAVAILABLE with RetryInfo
            list(s.stub.Generate(gen()))
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE and "RetryInfo" in details(ei.value)
        s.load()
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        watch.cancel()
    finally:
        s.stop()


def test_queue_full_is_resource_exhausted_with_retry_info():
    with ServerThread(fake_engine_factory(max_num_seqs=1, step_delay=0.01), max_waiting_requests=1) as s:
        running = s.stub.Generate(gen(max_tokens=200, stream=True))
        next(running)
        waiting = s.stub.Generate(gen(max_tokens=5, stream=True))
        waiting.initial_metadata()
        time.sleep(0.1)
        with pytest.raises(grpc.RpcError) as ei:
            list(s.stub.Generate(gen()))
        assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert details(ei.value)["RetryInfo"].retry_delay.seconds >= 1
        running.cancel()
        assert list(waiting)[-1].finish.reason == pb.FinishInfo.REASON_LENGTH


def test_engine_death_unavailable_and_not_serving():
    with ServerThread(fake_engine_factory(fail_after=30, step_delay=0.002)) as s:
        with pytest.raises(grpc.RpcError) as ei:
            list(s.stub.Generate(gen(max_tokens=100, stream=True)))
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
        h = health_pb2_grpc.HealthStub(s.channel)
        deadline = time.monotonic() + 10
        while h.Check(health_pb2.HealthCheckRequest(service=SERVICE)).status != health_pb2.HealthCheckResponse.NOT_SERVING:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        with pytest.raises(grpc.RpcError) as ei:
            list(s.stub.Generate(gen()))
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
        assert s.server.engine_died


def test_graceful_shutdown_lets_in_flight_finish():
    s = ServerThread(fake_engine_factory(step_delay=0.01))
    try:
        call = s.stub.Generate(gen(max_tokens=30, stream=True))
        next(call)
        fut = __import__("asyncio").run_coroutine_threadsafe(s.server.shutdown(grace=20.0), s.loop)
        time.sleep(0.05)
        with pytest.raises(grpc.RpcError) as ei:
            list(s.stub.Generate(gen()))
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
        rest = list(call)
        assert rest[-1].finish.reason == pb.FinishInfo.REASON_LENGTH
        fut.result(30)
    finally:
        s.stop()


@pytest.mark.parametrize("method", ["Generate", "Tokenize", "GetModelInfo"])
def test_undecodable_request_bytes_are_invalid_argument(srv, method):
    # grpc.aio's own answer was UNKNOWN "Unexpected <class '...DecodeError'>"
    call = (srv.channel.unary_stream if method == "Generate" else srv.channel.unary_unary)(
        f"/{SERVICE}/{method}", request_serializer=lambda b: b, response_deserializer=lambda b: b)
    with pytest.raises(grpc.RpcError) as ei:
        result = call(b"\xff\xff\xff", timeout=10)
        list(result) if method == "Generate" else result
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a valid message" in ei.value.details()
    assert list(srv.stub.Generate(gen(max_tokens=2)))[-1].HasField("finish")  # and nothing else changed
