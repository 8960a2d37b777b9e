"""A scripted llmsvc.v1 server for the client tests: grpc.aio on 127.0.0.1, in its own thread.

Generate "generates" the prompt text one character per token (token id = code point), so a
test knows the expected output without a model. Special prompts script failures:
  "error:<CODE>"  abort with that status and docs/api.md's google.rpc details for it
  "midstream"     one delta, then INTERNAL (ErrorInfo carries the request id)
  "wait"          one delta, then block until cancelled or aborted (records cancellation)
Health ("" SERVING, llmsvc.v1.LlmService NOT_SERVING) and reflection are registered too.
"""
from __future__ import annotations

import asyncio
import threading

import grpc
import grpc.aio
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection
from grpc_status import rpc_status

from llmsvc.v1 import llmsvc_pb2 as pb
from llmsvc.v1 import llmsvc_pb2_grpc as pb_grpc

SERVICE = pb.DESCRIPTOR.services_by_name["LlmService"].full_name


def _any(msg) -> any_pb2.Any:
    a = any_pb2.Any()
    a.Pack(msg)
    return a


def rich_status(code_name: str, request_id: str) -> status_pb2.Status:
    """The status (with details) docs/api.md's error table prescribes for `code_name`."""
    code = getattr(code_pb2, code_name, code_pb2.INVALID_ARGUMENT)
    details = []
    if code_name == "INVALID_ARGUMENT":
        message = "sampling.temperature must be >= 0, got -1"
        details = [error_details_pb2.BadRequest(field_violations=[error_details_pb2.BadRequest.FieldViolation(
                       field="sampling.temperature", description="must be >= 0, got -1")]),
                   error_details_pb2.ErrorInfo(reason="INVALID_SAMPLING", domain="llmsvc")]
    elif code_name == "PROMPT_TOO_LONG":
        code, message = code_pb2.INVALID_ARGUMENT, "prompt has 9000 tokens; max_model_len is 8192"
        details = [error_details_pb2.ErrorInfo(reason="PROMPT_TOO_LONG", domain="llmsvc",
                                               metadata={"prompt_tokens": "9000", "max_model_len": "8192"})]
    elif code_name in ("RESOURCE_EXHAUSTED", "UNAVAILABLE"):
        message = f"{code_name.lower()}: try again later"
        details = [error_details_pb2.RetryInfo(retry_delay=duration_pb2.Duration(seconds=2, nanos=500_000_000))]
    elif code_name == "INTERNAL":
        message = "internal error"
        details = [error_details_pb2.ErrorInfo(reason="INTERNAL", domain="llmsvc",
                                               metadata={"request_id": request_id})]
    elif code_name == "FAILED_PRECONDITION":
        message = "the model has no chat template"
        details = [error_details_pb2.ErrorInfo(reason="NO_CHAT_TEMPLATE", domain="llmsvc")]
    else:
        message = f"scripted {code_name}"
    return status_pb2.Status(code=code, message=message, details=[_any(d) for d in details])


class FakeLlmService(pb_grpc.LlmServiceServicer):
    def __init__(self):
        self.requests: list[pb.GenerateRequest] = []
        self.metadata: list[dict[str, str]] = []
        self.in_flight: dict[str, asyncio.Event] = {}
        self.cancelled: list[str] = []
        self.cancelled_event = threading.Event()
        self._next_id = 0

    def _request_id(self, request, md) -> str:
        if request.request_id:
            return request.request_id
        if "x-request-id" in md:
            return md["x-request-id"]
        self._next_id += 1
        return f"srv-{self._next_id}"

    async def Generate(self, request, context):
        md = {k: v for k, v in context.invocation_metadata() if isinstance(v, str)}
        self.requests.append(request)
        self.metadata.append(md)
        rid = self._request_id(request, md)
        await context.send_initial_metadata((("x-request-id", rid),))
        text = request.text
        if text.startswith("error:"):
            await context.abort_with_status(rpc_status.to_status(rich_status(text[6:], rid)))
        prompt = pb.PromptInfo(num_prompt_tokens=len(text))
        if text in ("midstream", "wait"):
            aborted = self.in_flight[rid] = asyncio.Event()  # registered before the client can see it
            # a cancel can land at either suspension point: the write of "x" may still be completing
            # when the client has read it and left (GeneratorExit there), or at the wait below
            try:
                yield pb.GenerateResponse(request_id=rid, text="x", token_ids=[120], prompt=prompt,
                                          num_output_tokens=1)
                if text == "midstream":
                    await context.abort_with_status(rpc_status.to_status(rich_status("INTERNAL", rid)))
                await aborted.wait()
            except (asyncio.CancelledError, GeneratorExit):
                self.cancelled.append(rid)
                self.cancelled_event.set()
                raise
            finally:
                self.in_flight.pop(rid, None)
            yield pb.GenerateResponse(request_id=rid, num_output_tokens=1, finish=pb.FinishInfo(
                reason=pb.FinishInfo.REASON_ABORTED, abort_reason="test"))
            return
        limit = request.stopping.max_tokens if request.stopping.HasField("max_tokens") else len(text)
        out = text[:limit]
        reason = pb.FinishInfo.REASON_LENGTH if limit < len(text) else pb.FinishInfo.REASON_STOP
        n = request.sampling.n if request.sampling.HasField("n") else 1

        def finish():
            return pb.FinishInfo(reason=reason, usage=pb.Usage(prompt_tokens=len(text), completion_tokens=len(out)),
                                 **({"eos_token_id": 0} if reason == pb.FinishInfo.REASON_STOP else {}))

        if not request.stream:
            for i in range(n):
                yield pb.GenerateResponse(request_id=rid, index=i, text=out, token_ids=[ord(c) for c in out],
                                          num_output_tokens=len(out), finish=finish(),
                                          **({"prompt": prompt} if i == 0 else {}))
            return
        yield pb.GenerateResponse(request_id=rid, prompt=prompt)
        for pos, c in enumerate(out):
            for i in range(n):
                yield pb.GenerateResponse(request_id=rid, index=i, text=c, token_ids=[ord(c)],
                                          num_output_tokens=pos + 1)
        for i in range(n):
            yield pb.GenerateResponse(request_id=rid, index=i, num_output_tokens=len(out), finish=finish())

    async def Abort(self, request, context):
        found = [r for r in request.request_ids if r in self.in_flight]
        for r in found:
            self.in_flight[r].set()
        return pb.AbortResponse(aborted=found, not_found=[r for r in request.request_ids if r not in found])

    async def Tokenize(self, request, context):
        if request.WhichOneof("input") != "text":
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "chat tokenize not scripted")
        if request.text == "slow":  # a unary call still in flight a while
            await asyncio.sleep(5)
        return pb.TokenizeResponse(token_ids=[ord(c) for c in request.text],
                                   pieces=list(request.text) if request.return_pieces else [],
                                   max_model_len=8192)

    async def Detokenize(self, request, context):
        return pb.DetokenizeResponse(text="".join(chr(t) for t in request.token_ids))

    async def GetModelInfo(self, request, context):
        return pb.GetModelInfoResponse(model_id="fake", max_model_len=8192, vocab_size=0x110000,
                                       eos_token_ids=[0], supported_constraints=[])

    async def GetServerInfo(self, request, context):
        return pb.GetServerInfoResponse(version="0.0-test", api_version="llmsvc.v1", num_kv_blocks=16,
                                        num_free_kv_blocks=16)


class FakeServer:
    """Runs the fake service, health and reflection on 127.0.0.1:<free port> in a thread."""

    def __init__(self):
        self.service = FakeLlmService()
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.port = 0

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def _start(self):
        self.server = grpc.aio.server()
        pb_grpc.add_LlmServiceServicer_to_server(self.service, self.server)
        health = HealthServicer()
        await health.set("", health_pb2.HealthCheckResponse.SERVING)
        await health.set(SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(health, self.server)
        reflection.enable_server_reflection(
            [SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
            self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()

    def __enter__(self) -> FakeServer:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)
        return self

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(None), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()
