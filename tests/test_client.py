"""llmsvc.client against a scripted grpc.aio server on loopback (tests/fake_llm_server.py)."""
from __future__ import annotations

import asyncio
import gc
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from fake_llm_server import FakeServer
from llmsvc.client import errors
from llmsvc.client.aio import AsyncClient
from llmsvc.client.client import Client
from llmsvc.client.request import GENERATE_KWARGS, build_generate_request
from llmsvc.v1 import llmsvc_pb2 as pb

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def server():
    with FakeServer() as srv:
        yield srv


@pytest.fixture
def client(server):
    with Client(server.target, timeout=10) as c:
        yield c


# --- request building ------------------------------------------------------------------------

def test_kwargs_route_to_the_message_that_owns_the_field():
    req = build_generate_request("Hi", request_id="r1", max_tokens=7, min_tokens=2, temperature=0.0,
                                 top_k=-1, seed=2**40, stop="END", stop_token_ids=[5], logprobs=0,
                                 prompt_token_ids=True, priority=-3, truncate_prompt_tokens=100,
                                 labels={"tenant": "t"}, regex="[a-z]+", add_special_tokens=False)
    assert req.WhichOneof("prompt") == "text" and req.text == "Hi" and req.request_id == "r1"
    assert not req.stream
    assert req.stopping.max_tokens == 7 and req.stopping.min_tokens == 2
    assert list(req.stopping.stop) == ["END"] and list(req.stopping.stop_token_ids) == [5]
    assert req.sampling.HasField("temperature") and req.sampling.temperature == 0.0
    assert req.sampling.top_k == -1 and req.sampling.seed == 2**40
    assert req.sampling.WhichOneof("constraint") == "regex"
    # logprobs=0 is a real value (sampled token only), not "unset"
    assert req.output.HasField("logprobs") and req.output.logprobs == 0 and req.output.prompt_token_ids
    assert req.priority == -3 and req.truncate_prompt_tokens == 100 and dict(req.labels) == {"tenant": "t"}
    assert req.HasField("add_special_tokens") and not req.add_special_tokens


def test_unset_kwargs_stay_unset_on_the_wire():
    req = build_generate_request("Hi", max_tokens=None, temperature=None)
    assert not req.HasField("sampling") and not req.HasField("stopping") and not req.HasField("output")
    req = build_generate_request("Hi", top_p=0.5)
    for name in ("temperature", "top_k", "min_p", "seed", "n", "repetition_penalty"):
        assert not req.sampling.HasField(name), name


def test_prompt_kinds_and_sections():
    ids = build_generate_request([1, 2, 3], stream=True)
    assert ids.WhichOneof("prompt") == "token_ids" and list(ids.token_ids.ids) == [1, 2, 3] and ids.stream
    chat = build_generate_request(messages=[{"role": "system", "content": "s"}, ("user", "u")],
                                  add_generation_prompt=True)
    assert [(m.role, m.content) for m in chat.chat.messages] == [("system", "s"), ("user", "u")]
    assert chat.chat.add_generation_prompt
    sec = build_generate_request("x", output={"text": False, "token_ids": True}, sampling={"top_p": 0.9},
                                 choice=["yes", "no"], json_schema=None)
    assert sec.output.HasField("text") and not sec.output.text and sec.output.token_ids
    assert abs(sec.sampling.top_p - 0.9) < 1e-6 and list(sec.sampling.choice.choices) == ["yes", "no"]
    schema = build_generate_request("x", json_schema={"type": "object"})
    assert '"object"' in schema.sampling.json_schema


def test_bad_kwargs_are_rejected_not_ignored():
    with pytest.raises(TypeError, match="max_new_tokens"):
        build_generate_request("x", max_new_tokens=3)
    with pytest.raises(TypeError, match="output="):
        build_generate_request("x", token_ids=False)
    with pytest.raises(TypeError):
        build_generate_request()
    with pytest.raises(TypeError):
        build_generate_request("x", messages=[("user", "y")])
    with pytest.raises(TypeError, match="at most one output constraint, got regex and choice"):
        build_generate_request("x", regex="a+", choice=["a"])  # a oneof: the second would replace the first
    with pytest.raises(TypeError, match="at most one output constraint, got json_schema and regex"):
        build_generate_request("x", sampling={"json_schema": "{}", "regex": "a"})
    with pytest.raises(TypeError, match="at most one output constraint, got regex and json_object"):
        build_generate_request("x", sampling=pb.SamplingParams(regex="a"), json_object=True)
    # protobuf's own errors ("must assign iterable", "Value out of range") name the field
    with pytest.raises(TypeError, match="stop_token_ids=5"):
        build_generate_request("x", stop_token_ids=5)
    with pytest.raises(ValueError, match="seed=-1"):
        build_generate_request("x", seed=-1)
    with pytest.raises(TypeError, match="temperature='hot'"):
        build_generate_request("x", sampling={"temperature": "hot"})


def test_sections_given_whole_take_the_protos_shapes_and_keywords_override_them():
    # a dict in the proto's shape used to become the choice "choices" (a dict iterates its keys)
    assert list(build_generate_request("x", sampling={"choice": {"choices": ["yes", "no"]}})
                .sampling.choice.choices) == ["yes", "no"]
    assert list(build_generate_request("x", choice=pb.Choices(choices=["a", "b"])).sampling.choice.choices) == ["a", "b"]
    assert list(build_generate_request("x", stopping={"stop": ["a"]}, stop=["b"]).stopping.stop) == ["b"]
    assert build_generate_request("x", sampling={"regex": "a"}, regex="b").sampling.regex == "b"
    assert dict(build_generate_request("x", labels={"k": "v"}).labels) == {"k": "v"}
    assert build_generate_request("x", json_object=False).sampling.WhichOneof("constraint") is None  # off
    # every documented kwarg is a real field of some request message
    owners = [pb.SamplingParams, pb.StoppingCriteria, pb.OutputOptions, pb.GenerateRequest, pb.ChatPrompt]
    for name in GENERATE_KWARGS:
        assert any(name in o.DESCRIPTOR.fields_by_name for o in owners), name


# --- calls -----------------------------------------------------------------------------------

def test_generate_non_streaming(client, server):
    res = client.generate("hello", max_tokens=3, request_id="gen-1", labels={"k": "v"})
    assert res.request_id == "gen-1"
    assert res.text == "hel" and res.token_ids == [ord(c) for c in "hel"]
    assert res.finish_reason == "length" and res.usage.completion_tokens == 3
    assert res.prompt.num_prompt_tokens == 5
    sent = server.service.requests[-1]
    assert not sent.stream and sent.stopping.max_tokens == 3 and dict(sent.labels) == {"k": "v"}


def test_stream_deltas_concatenate_and_first_message_has_id(client, server):
    stream = client.generate_stream("héllo wörld")
    assert stream.wait_request_id().startswith("srv-")  # from initial metadata, before any token
    msgs = list(stream)
    assert msgs[0].request_id == stream.request_id and msgs[0].HasField("prompt") and not msgs[0].token_ids
    assert all(m.request_id == stream.request_id for m in msgs)
    assert "".join(m.text for m in msgs) == "héllo wörld" == stream.result.text
    assert stream.result.finish_reason == "stop" and stream.result.outputs[0].stop_reason == 0
    assert sum(m.HasField("finish") for m in msgs) == 1 and msgs[-1].HasField("finish")
    assert server.service.requests[-1].stream


def test_stream_n_outputs_are_separated_by_index(client):
    res = client.generate_stream("abc", n=3).until_done()
    assert [o.index for o in res.outputs] == [0, 1, 2]
    assert all(o.text == "abc" and o.finish_reason == "stop" for o in res.outputs) and res.finished


def test_token_and_metadata_are_sent(server):
    with Client(server.target, token="s3cret", metadata=[("x-tenant", "a")]) as c:
        c.generate("ok")
    md = server.service.metadata[-1]
    assert md["authorization"] == "Bearer s3cret" and md["x-tenant"] == "a"


def test_unary_methods(client):
    tok = client.tokenize("añb", return_pieces=True)
    assert list(tok.token_ids) == [ord(c) for c in "añb"] and list(tok.pieces) == ["a", "ñ", "b"]
    assert client.detokenize(tok.token_ids) == "añb"
    assert client.model_info().max_model_len == 8192
    assert client.server_info().api_version == "llmsvc.v1"
    assert client.health() == "SERVING"
    assert client.health("llmsvc.v1.LlmService") == "NOT_SERVING"
    with pytest.raises(errors.NotFound):
        client.health("no.such.Service")
    with pytest.raises(errors.Unimplemented):
        client.tokenize(messages=[("user", "x")])


def test_leaving_a_stream_early_cancels_the_call(client, server):
    server.service.cancelled_event.clear()
    stream = client.generate_stream("wait", request_id="cancel-me")
    for msg in stream:
        assert msg.text == "x"
        break  # closes the generator -> call.cancel()
    assert server.service.cancelled_event.wait(5)
    assert "cancel-me" in server.service.cancelled


def test_abort_ends_stream_with_aborted_and_reports_unknown_ids(client, server):
    stream = client.generate_stream("wait", request_id="to-abort")
    it = iter(stream)
    assert next(it).text == "x"
    assert client.abort(["to-abort", "ghost"]) == ["ghost"]
    rest = list(it)
    assert rest[-1].finish.reason == pb.FinishInfo.REASON_ABORTED
    assert stream.result.finish_reason == "abort" and stream.result.text == "x"


def test_deadline_exceeded(client):
    with pytest.raises(errors.DeadlineExceeded):
        client.generate("wait", timeout=0.3)


# --- errors ----------------------------------------------------------------------------------

@pytest.mark.parametrize("code_name, cls", [
    ("INVALID_ARGUMENT", errors.InvalidArgument),
    ("PROMPT_TOO_LONG", errors.PromptTooLong),
    ("FAILED_PRECONDITION", errors.FailedPrecondition),
    ("UNIMPLEMENTED", errors.Unimplemented),
    ("ALREADY_EXISTS", errors.AlreadyExists),
    ("RESOURCE_EXHAUSTED", errors.ResourceExhausted),
    ("UNAVAILABLE", errors.Unavailable),
    ("DEADLINE_EXCEEDED", errors.DeadlineExceeded),
    ("INTERNAL", errors.Internal),
    ("UNAUTHENTICATED", errors.Unauthenticated),
])
def test_status_codes_map_to_typed_exceptions(client, code_name, cls):
    with pytest.raises(cls) as info:
        client.generate(f"error:{code_name}", request_id=f"e-{code_name}")
    err = info.value
    assert type(err) is cls and isinstance(err, errors.LlmsvcError)
    assert err.code == cls.code and err.message and err.code.name in str(err)


def test_rich_details_are_decoded(client):
    with pytest.raises(errors.InvalidArgument) as bad:
        client.generate("error:INVALID_ARGUMENT")
    assert bad.value.field_violations == [("sampling.temperature", "must be >= 0, got -1")]
    assert bad.value.reason == "INVALID_SAMPLING" and bad.value.domain == "llmsvc"

    with pytest.raises(errors.PromptTooLong) as long_:
        client.generate("error:PROMPT_TOO_LONG")
    assert long_.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert (long_.value.prompt_tokens, long_.value.max_model_len) == (9000, 8192)

    with pytest.raises(errors.ResourceExhausted) as busy:
        client.generate("error:RESOURCE_EXHAUSTED")
    assert busy.value.retry_delay == pytest.approx(2.5)

    with pytest.raises(errors.Internal) as internal:
        client.generate("error:INTERNAL", request_id="boom-1")
    assert internal.value.request_id == "boom-1" and internal.value.metadata["request_id"] == "boom-1"

    with pytest.raises(errors.AlreadyExists) as dup:
        client.generate("error:ALREADY_EXISTS")
    assert dup.value.details == [] and dup.value.retry_delay is None and dup.value.reason is None


def test_mid_stream_failure_keeps_received_deltas(client):
    stream = client.generate_stream("midstream", request_id="mid-1")
    got = []
    with pytest.raises(errors.Internal) as info:
        for msg in stream:
            got.append(msg.text)
    assert got == ["x"] and stream.result.text == "x" and info.value.request_id == "mid-1"


def test_unreachable_server_is_unavailable():
    with Client("127.0.0.1:1", timeout=5) as c, pytest.raises(errors.Unavailable):
        c.model_info()


# --- asyncio ---------------------------------------------------------------------------------

def test_async_client(server):
    async def main():
        async with AsyncClient(server.target, timeout=10) as c:
            res = await c.generate("async!", max_tokens=4)
            assert (res.text, res.finish_reason) == ("asyn", "length")
            stream = c.generate_stream("stream me")
            assert (await stream.wait_request_id()).startswith("srv-")
            texts = [m.text async for m in stream]
            assert "".join(texts) == "stream me" == stream.result.text
            assert await c.detokenize([104, 105]) == "hi"
            assert await c.health() == "SERVING"
            with pytest.raises(errors.PromptTooLong):
                await c.generate("error:PROMPT_TOO_LONG")
            with pytest.raises(errors.ResourceExhausted) as busy:
                async for _ in c.generate_stream("error:RESOURCE_EXHAUSTED"):
                    pass
            assert busy.value.retry_delay == pytest.approx(2.5)
            wait = c.generate_stream("wait", request_id="async-abort")
            async for msg in wait:
                if msg.text == "x":
                    assert await c.abort("async-abort") == []
            assert wait.result.finish_reason == "abort"
            server.service.cancelled_event.clear()
            async for _ in c.generate_stream("wait", request_id="async-cancel"):
                break
        return True

    assert asyncio.run(main())
    assert server.service.cancelled_event.wait(5) and "async-cancel" in server.service.cancelled


@pytest.mark.skipif(sys.version_info < (3, 11), reason="Task.cancelling() (3.11) tells a call's end from the task's")
def test_async_call_ended_on_this_side_raises_cancelled_and_a_dropped_stream_is_cancelled(server):
    # grpc.aio ends a call cancelled on this side (cancel() from another task, the channel
    # closed) with asyncio.CancelledError in the task reading it; that task was not cancelled,
    # so it gets Cancelled, as from the blocking client. A stream dropped unread cancels its call.
    async def read(stream, first: asyncio.Event):
        async for _ in stream:
            first.set()

    async def cancelled_elsewhere(c, end):
        stream, first = c.generate_stream("wait"), asyncio.Event()
        task = asyncio.create_task(read(stream, first))
        await asyncio.wait_for(first.wait(), 5)
        await end(stream)
        with pytest.raises(errors.Cancelled) as ei:
            await task
        assert ei.value.code == grpc.StatusCode.CANCELLED and ei.value.request_id.startswith("srv-")

    async def main():
        async with AsyncClient(server.target, timeout=10) as c:
            async def cancel(stream):
                stream.cancel()
            await cancelled_elsewhere(c, cancel)
            # the reading task cancelled itself still sees CancelledError
            stream, first = c.generate_stream("wait"), asyncio.Event()
            task = asyncio.create_task(read(stream, first))
            await asyncio.wait_for(first.wait(), 5)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            server.service.cancelled_event.clear()
            stream = c.generate_stream("wait", request_id="async-dropped")
            assert await stream.wait_request_id() == "async-dropped"
            for _ in range(100):  # the fake service registers the call after its headers went out
                if "async-dropped" in server.service.in_flight:
                    break
                await asyncio.sleep(0.05)
            del stream
            gc.collect()
            for _ in range(100):
                if "async-dropped" in server.service.cancelled:
                    break
                await asyncio.sleep(0.05)
            assert "async-dropped" in server.service.cancelled
        c = AsyncClient(server.target, timeout=10)

        async def close(_stream):
            await c.close()
        await cancelled_elsewhere(c, close)
        c = AsyncClient(server.target, timeout=10)  # a unary call under a channel closed elsewhere
        task = asyncio.create_task(c.tokenize("slow"))
        await asyncio.sleep(0.5)
        await c.close()
        with pytest.raises(errors.Cancelled):
            await task

    asyncio.run(main())


def test_client_imports_neither_torch_nor_engine_nor_server():
    code = ("import sys, llmsvc.client\n"
            "from llmsvc.client import Client, AsyncClient, LlmsvcError\n"
            "import llmsvc.client.cli, llmsvc.client.health_cli, llmsvc.client.reflection\n"
            "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'numpy')\n"
            "       or m.startswith(('llmsvc.engine', 'llmsvc.server', 'llmsvc.worker', 'llmsvc.models'))]\n"
            "assert not bad, bad\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]


def test_a_call_that_fails_before_output_keeps_its_id_and_an_empty_result():
    # the server names a request in its headers once it took it: a non-streamed call that then
    # fails (its deadline, here) carries the id; a stream that failed before any message has an
    # empty result, not a ValueError
    from tests.server_harness import ServerThread, fake_engine_factory
    with ServerThread(fake_engine_factory(step_delay=0.05)) as s, Client(s.address) as c:
        with pytest.raises(errors.DeadlineExceeded) as ei:
            c.generate("slow", max_tokens=100, ignore_eos=True, timeout=1.0)
        assert ei.value.request_id
        stream = c.generate_stream("slow", max_tokens=100, ignore_eos=True, timeout=0.02)
        with pytest.raises(errors.DeadlineExceeded):
            for _ in stream:
                pass
        assert (stream.result.text, stream.result.token_ids, stream.result.finish_reason) == ("", [], None)


def test_a_closed_client_says_so_on_every_call(server):
    with Client(server.target, timeout=10) as c:
        assert c.tokenize("hi").token_ids
    for call in (lambda: c.tokenize("hi"), lambda: c.generate("hi", max_tokens=2),
                 lambda: list(c.generate_stream("hi", max_tokens=2)), c.model_info):
        with pytest.raises(errors.ClientClosed, match="client is closed"):
            call()

    async def main():
        a = AsyncClient(server.target, timeout=10)
        await a.close()
        with pytest.raises(errors.ClientClosed):
            await a.tokenize("hi")
        with pytest.raises(errors.LlmsvcError):  # ClientClosed is one of the client's errors
            await a.generate("hi", max_tokens=2)
    asyncio.run(main())
