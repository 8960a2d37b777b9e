"""asyncio llmsvc client: the same methods as `Client`, awaitable (grpc.aio channel).

    async with AsyncClient("localhost:50051") as c:
        async for delta in c.generate_stream("Hello", max_tokens=16):
            print(delta.text, end="")
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any, NoReturn

import grpc
import grpc.aio

from llmsvc.client import channel as ch
from llmsvc.client.client import _UNSET, ClientBase
from llmsvc.client.errors import Cancelled, from_rpc_error
from llmsvc.client.request import (build_detokenize_request, build_drain_request, build_generate_request,
                                   build_tokenize_request)
from llmsvc.client.result import GenerateResult, ResultBuilder
from llmsvc.v1 import llmsvc_pb2 as pb
from llmsvc.v1 import llmsvc_pb2_grpc as pb_grpc


def _cancelled_call(request_id: str | None = None) -> NoReturn:
    """In an `except asyncio.CancelledError`: grpc.aio ends a call cancelled on this side
    (`cancel()`, the channel closed) with CancelledError in whichever task awaits it. Unless
    that task is itself being cancelled (which Python 3.11+ can tell; before, every one is taken
    as the task's), the call ended, not the task: raise what the blocking client raises."""
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)
    if task is None or cancelling is None or cancelling() > 0:
        raise  # noqa: PLE0704 - re-raises the CancelledError being handled
    raise Cancelled("Locally cancelled by application!", code=grpc.StatusCode.CANCELLED,
                    request_id=request_id) from None


class AsyncGenerateStream:
    """An in-flight streamed Generate: `async for` it for GenerateResponse deltas.

    `await wait_request_id()` returns the id before any token (from the server's initial
    metadata when the server made it). Leaving the iteration early, `cancel()`, or dropping
    the stream unread cancels the call, which aborts the request on the server; a call
    cancelled from another task ends this one's iteration with `Cancelled`.
    """

    def __init__(self, call: grpc.aio.UnaryStreamCall, request_id: str | None):
        self._call = call
        self.request_id = request_id or None
        self._builder = ResultBuilder(request_id or "")

    def __del__(self) -> None:
        # grpc.aio sends the request at once and keeps the call alive on its own: a stream
        # dropped before it was read would otherwise generate until max_tokens
        # (through the call's loop: a collection may run on another thread)
        call = getattr(self, "_call", None)
        loop = getattr(call, "_loop", None)
        try:
            if call is not None and not call.done():
                if loop is None:
                    call.cancel()
                elif not loop.is_closed():
                    loop.call_soon_threadsafe(call.cancel)
        except Exception:  # noqa: BLE001 - the loop may be gone at interpreter exit
            pass

    async def wait_request_id(self) -> str | None:
        if self.request_id is None:
            try:
                self.request_id = ch.request_id_from_metadata(await self._call.initial_metadata())
            except grpc.RpcError as err:
                raise from_rpc_error(err) from None
            except asyncio.CancelledError:
                _cancelled_call()
        return self.request_id

    async def __aiter__(self) -> AsyncIterator[pb.GenerateResponse]:
        try:
            async for msg in self._call:
                if self.request_id is None and msg.request_id:
                    self.request_id = msg.request_id
                self._builder.add(msg)
                yield msg
        except grpc.RpcError as err:
            if self.request_id is None:  # the server named it in its headers, if it took the call
                try:
                    self.request_id = ch.request_id_from_metadata(await self._call.initial_metadata())
                except Exception:  # noqa: BLE001 - the call's own error is what matters
                    pass
            raise from_rpc_error(err, self.request_id) from None
        except asyncio.CancelledError:
            _cancelled_call(self.request_id)
        finally:
            self._call.cancel()  # no-op once the call has completed

    @property
    def result(self) -> GenerateResult:
        return self._builder.result

    async def until_done(self) -> GenerateResult:
        async for _ in self:
            pass
        return self.result

    def cancel(self) -> None:
        self._call.cancel()

    async def __aenter__(self) -> AsyncGenerateStream:
        return self

    async def __aexit__(self, *exc) -> None:
        self.cancel()


class AsyncClient(ClientBase):
    """Client over a grpc.aio channel; create it inside the event loop that uses it.
    max_retries: as Client's."""

    def __init__(self, target: str, *, timeout: float | None = None, credentials: ch.Credentials = None,
                 token: str | None = None, compression: grpc.Compression | str | None = None,
                 metadata: Sequence[tuple[str, str]] = (), options: Sequence[tuple[str, Any]] = (),
                 max_retries: int = 0):
        super().__init__(target, timeout=timeout, credentials=credentials, token=token,
                         compression=compression, metadata=metadata)
        self.max_retries = max_retries
        opts = ch.channel_options(max_retries, options)
        if self._creds is None:
            self._channel = grpc.aio.insecure_channel(target, options=opts)
        else:
            self._channel = grpc.aio.secure_channel(target, self._creds, options=opts)
        self.stub = pb_grpc.LlmServiceStub(self._channel)
        self.admin_stub = pb_grpc.AdminServiceStub(self._channel)

    async def _unary(self, method, request, timeout, metadata=None):
        try:
            return await method(request, **self._kw(timeout, metadata))
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None
        except asyncio.CancelledError:  # the channel was closed under the call
            _cancelled_call()

    def generate_stream(self, prompt: str | Sequence[int] | None = None, *, messages=None,
                        request_id: str | None = None, timeout: float | None = _UNSET,
                        metadata: Sequence[tuple[str, str]] | None = None, **fields) -> AsyncGenerateStream:
        """Start a streamed Generate (stream=true); `async for` the returned stream."""
        req = build_generate_request(prompt, messages=messages, request_id=request_id, stream=True, **fields)
        return AsyncGenerateStream(self.stub.Generate(req, **self._kw(timeout, metadata)), request_id)

    async def generate(self, prompt: str | Sequence[int] | None = None, *, messages=None,
                       request_id: str | None = None, timeout: float | None = _UNSET,
                       metadata: Sequence[tuple[str, str]] | None = None, **fields) -> GenerateResult:
        """One non-streamed Generate (stream=false)."""
        req = build_generate_request(prompt, messages=messages, request_id=request_id, stream=False, **fields)
        stream = AsyncGenerateStream(self.stub.Generate(req, **self._kw(timeout, metadata)), request_id)
        return await stream.until_done()

    async def abort(self, request_ids: str | Sequence[str], reason: str = "", *,
                    timeout: float | None = _UNSET) -> list[str]:
        """Abort in-flight requests by id; returns the ids the server did not find."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        resp = await self._unary(self.stub.Abort, pb.AbortRequest(request_ids=ids, reason=reason), timeout)
        return list(resp.not_found)

    async def tokenize(self, text: str | None = None, *, messages=None, timeout: float | None = _UNSET,
                       **kwargs) -> pb.TokenizeResponse:
        req = build_tokenize_request(text, messages=messages, **kwargs)
        return await self._unary(self.stub.Tokenize, req, timeout)

    async def detokenize(self, token_ids: Sequence[int], *, skip_special_tokens: bool | None = None,
                         timeout: float | None = _UNSET) -> str:
        req = build_detokenize_request(token_ids, skip_special_tokens=skip_special_tokens)
        return (await self._unary(self.stub.Detokenize, req, timeout)).text

    async def drain(self, grace_seconds: float | None = None, *,
                    timeout: float | None = _UNSET) -> pb.DrainResponse:
        """AdminService.Drain (the client's token must be an admin token): the server begins a
        graceful shutdown; in-flight requests get grace_seconds (None: the server's own)."""
        return await self._unary(self.admin_stub.Drain, build_drain_request(grace_seconds), timeout)

    async def flush_cache(self, *, timeout: float | None = _UNSET) -> None:
        """AdminService.FlushCache (admin token): empty the prefix cache; FailedPrecondition
        while requests hold KV blocks."""
        await self._unary(self.admin_stub.FlushCache, pb.FlushCacheRequest(), timeout)

    async def load_lora_adapter(self, lora_name: str, lora_path: str, *,
                                timeout: float | None = _UNSET) -> pb.LoraAdapter:
        """AdminService.LoadLoraAdapter (admin token), as Client.load_lora_adapter."""
        req = pb.LoadLoraAdapterRequest(lora_name=lora_name, lora_path=lora_path)
        return (await self._unary(self.admin_stub.LoadLoraAdapter, req, timeout)).adapter

    async def unload_lora_adapter(self, lora_name: str, *, timeout: float | None = _UNSET) -> None:
        """AdminService.UnloadLoraAdapter (admin token), as Client.unload_lora_adapter."""
        await self._unary(self.admin_stub.UnloadLoraAdapter, pb.UnloadLoraAdapterRequest(lora_name=lora_name),
                          timeout)

    async def model_info(self, *, timeout: float | None = _UNSET) -> pb.GetModelInfoResponse:
        return await self._unary(self.stub.GetModelInfo, pb.GetModelInfoRequest(), timeout)

    async def server_info(self, *, timeout: float | None = _UNSET) -> pb.GetServerInfoResponse:
        return await self._unary(self.stub.GetServerInfo, pb.GetServerInfoRequest(), timeout)

    async def health(self, service: str = "", *, timeout: float | None = _UNSET) -> str:
        """grpc.health.v1 Check: "SERVING", "NOT_SERVING", ... (NotFound for an unknown service)."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        stub = health_pb2_grpc.HealthStub(self._channel)
        resp = await self._unary(stub.Check, health_pb2.HealthCheckRequest(service=service), timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)

    async def health_watch(self, service: str = "", *, timeout: float | None = None) -> AsyncIterator[str]:
        """grpc.health.v1 Watch: yields the status name on every change until cancelled."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        call = health_pb2_grpc.HealthStub(self._channel).Watch(
            health_pb2.HealthCheckRequest(service=service), **self._kw(timeout))
        try:
            async for resp in call:
                yield health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None
        except asyncio.CancelledError:
            _cancelled_call()
        finally:
            call.cancel()

    async def close(self) -> None:
        self._closed = True
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
