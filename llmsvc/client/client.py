"""Synchronous llmsvc client: `Client(target).generate("Hello", max_tokens=16)`.

Every method raises a subclass of `llmsvc.client.errors.LlmsvcError` on a non-OK status.
Keyword arguments of generate()/generate_stream() are proto field names (see request.py).
"""
from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Any

import grpc

from llmsvc.client import channel as ch
from llmsvc.client.errors import ClientClosed, from_rpc_error
from llmsvc.client.request import (build_detokenize_request, build_drain_request, build_generate_request,
                                   build_tokenize_request)
from llmsvc.client.result import GenerateResult, ResultBuilder
from llmsvc.v1 import llmsvc_pb2 as pb
from llmsvc.v1 import llmsvc_pb2_grpc as pb_grpc

_UNSET: Any = object()


class ClientBase:
    """Settings shared by Client and AsyncClient: default timeout, token, per-call options."""

    def __init__(self, target: str, *, timeout: float | None = None, credentials: ch.Credentials = None,
                 token: str | None = None, compression: grpc.Compression | str | None = None,
                 metadata: Sequence[tuple[str, str]] = ()):
        self.target = target
        self.timeout = timeout
        self._creds = ch.channel_credentials(credentials)
        self._token = token
        self._compression = ch.compression_of(compression)
        self._metadata = tuple(metadata)
        self._closed = False

    def _kw(self, timeout: float | None, metadata: Sequence[tuple[str, str]] | None = None,
            request_id: str | None = None) -> dict[str, Any]:
        """Keyword arguments for one stub call (every call takes them: ClientClosed once closed)."""
        if self._closed:
            raise ClientClosed("this client is closed; make a new one to call the server again")
        return {
            "timeout": self.timeout if timeout is _UNSET else timeout,
            "metadata": ch.call_metadata(self._token, (*self._metadata, *(metadata or ())), request_id),
            "compression": self._compression,
        }


class GenerateStream:
    """An in-flight streamed Generate: iterate it for GenerateResponse deltas.

    `request_id` is known before any token: it is the id you gave, else the server's initial
    metadata `x-request-id` (see `wait_request_id()`), else the first message's. `result`
    accumulates everything received so far. Leaving the iteration early cancels the call,
    which aborts the request on the server. `restart(seconds_left)` starts the call again
    for a retry: up to `max_retries` times, when the server refused it (UNAVAILABLE,
    RESOURCE_EXHAUSTED) before sending anything, within the call's deadline.
    """

    def __init__(self, call, request_id: str | None, restart=None, max_retries: int = 0,
                 timeout: float | None = None):
        self._call = call
        self.request_id = request_id or None
        self._builder = ResultBuilder(request_id or "")
        self._restart, self._retries_left = restart, max_retries if restart is not None else 0
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._attempt = 0

    def wait_request_id(self) -> str | None:
        """Block until the server's initial metadata arrives (before prefill) and return the id."""
        if self.request_id is None:
            try:
                self.request_id = ch.request_id_from_metadata(self._call.initial_metadata())
            except grpc.RpcError as err:
                raise from_rpc_error(err) from None
        return self.request_id

    def __iter__(self) -> Iterator[pb.GenerateResponse]:
        received = False
        try:
            while True:
                try:
                    for msg in self._call:
                        received = True
                        if self.request_id is None and msg.request_id:
                            self.request_id = msg.request_id
                        self._builder.add(msg)
                        yield msg
                    return
                except grpc.RpcError as err:
                    if received or not self._retry(err):
                        if self.request_id is None:  # the server named it in its headers, if it took the call
                            self.request_id = ch.request_id_from_metadata(err.initial_metadata())
                        raise from_rpc_error(err, self.request_id) from None
        finally:
            self._call.cancel()  # no-op once the call has completed

    def _retry(self, err: grpc.RpcError) -> bool:
        """Start the call again after the retry delay if `err` is a refusal worth retrying and
        a retry and the deadline allow it; False when the error stands."""
        if self._retries_left <= 0 or err.code().name not in ch.RETRYABLE_CODES or err.initial_metadata():
            return False  # headers came: the server took the request (gRPC's commit point too)
        self._attempt += 1
        delay = ch.retry_delay(err, self._attempt)
        left = None if self._deadline is None else self._deadline - time.monotonic() - delay
        if left is not None and left <= 0:
            return False
        self._retries_left -= 1
        time.sleep(delay)
        self._call = self._restart(left)
        return True

    @property
    def result(self) -> GenerateResult:
        return self._builder.result

    def until_done(self) -> GenerateResult:
        """Consume the rest of the stream and return the accumulated result."""
        for _ in self:
            pass
        return self.result

    def cancel(self) -> None:
        self._call.cancel()

    def __enter__(self) -> GenerateStream:
        return self

    def __exit__(self, *exc) -> None:
        self.cancel()


class Client(ClientBase):
    """Blocking client over one grpc channel. Use as a context manager or call close().

    max_retries (0-4, default 0): retry a call that the server refused before starting it
    (UNAVAILABLE: loading or draining; RESOURCE_EXHAUSTED: queue full) after the delay the
    server asked for; a stream that has started is never retried (channel.retry_service_config)."""

    def __init__(self, target: str, *, timeout: float | None = None, credentials: ch.Credentials = None,
                 token: str | None = None, compression: grpc.Compression | str | None = None,
                 metadata: Sequence[tuple[str, str]] = (), options: Sequence[tuple[str, Any]] = (),
                 max_retries: int = 0):
        super().__init__(target, timeout=timeout, credentials=credentials, token=token,
                         compression=compression, metadata=metadata)
        self.max_retries = max_retries
        opts = ch.channel_options(max_retries, options, retry_streams=False)  # Generate: GenerateStream
        if self._creds is None:
            self._channel = grpc.insecure_channel(target, options=opts)
        else:
            self._channel = grpc.secure_channel(target, self._creds, options=opts)
        self.stub = pb_grpc.LlmServiceStub(self._channel)
        self.admin_stub = pb_grpc.AdminServiceStub(self._channel)

    def _unary(self, method, request, timeout, metadata=None):
        try:
            return method(request, **self._kw(timeout, metadata))
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None

    def generate_stream(self, prompt: str | Sequence[int] | None = None, *, messages=None,
                        request_id: str | None = None, timeout: float | None = _UNSET,
                        metadata: Sequence[tuple[str, str]] | None = None, **fields) -> GenerateStream:
        """Start a streamed Generate (stream=true) and return it for iteration."""
        req = build_generate_request(prompt, messages=messages, request_id=request_id, stream=True, **fields)
        return self._generate(req, request_id, timeout, metadata)

    def generate(self, prompt: str | Sequence[int] | None = None, *, messages=None,
                 request_id: str | None = None, timeout: float | None = _UNSET,
                 metadata: Sequence[tuple[str, str]] | None = None, **fields) -> GenerateResult:
        """One non-streamed Generate (stream=false): the final text, token ids, finish and usage."""
        req = build_generate_request(prompt, messages=messages, request_id=request_id, stream=False, **fields)
        return self._generate(req, request_id, timeout, metadata).until_done()

    def _generate(self, req: pb.GenerateRequest, request_id, timeout, metadata) -> GenerateStream:
        kw = self._kw(timeout, metadata)
        return GenerateStream(self.stub.Generate(req, **kw), request_id, max_retries=self.max_retries,
                              restart=lambda left: self.stub.Generate(req, **{**kw, "timeout": left}),
                              timeout=kw["timeout"])

    def abort(self, request_ids: str | Sequence[str], reason: str = "", *,
              timeout: float | None = _UNSET) -> list[str]:
        """Abort in-flight requests by id; returns the ids the server did not find."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        resp = self._unary(self.stub.Abort, pb.AbortRequest(request_ids=ids, reason=reason), timeout)
        return list(resp.not_found)

    def tokenize(self, text: str | None = None, *, messages=None, timeout: float | None = _UNSET,
                 **kwargs) -> pb.TokenizeResponse:
        """Tokenize text (or chat messages); kwargs: add_special_tokens, add_generation_prompt,
        return_offsets, return_pieces, and for chat continue_final_message, tools,
        chat_template_kwargs."""
        return self._unary(self.stub.Tokenize, build_tokenize_request(text, messages=messages, **kwargs), timeout)

    def detokenize(self, token_ids: Sequence[int], *, skip_special_tokens: bool | None = None,
                   timeout: float | None = _UNSET) -> str:
        req = build_detokenize_request(token_ids, skip_special_tokens=skip_special_tokens)
        return self._unary(self.stub.Detokenize, req, timeout).text

    def drain(self, grace_seconds: float | None = None, *,
              timeout: float | None = _UNSET) -> pb.DrainResponse:
        """AdminService.Drain (the client's token must be an admin token): the server begins a
        graceful shutdown; in-flight requests get grace_seconds (None: the server's own)."""
        return self._unary(self.admin_stub.Drain, build_drain_request(grace_seconds), timeout)

    def flush_cache(self, *, timeout: float | None = _UNSET) -> None:
        """AdminService.FlushCache (admin token): empty the prefix cache; FailedPrecondition
        while requests hold KV blocks."""
        self._unary(self.admin_stub.FlushCache, pb.FlushCacheRequest(), timeout)

    def load_lora_adapter(self, lora_name: str, lora_path: str, *,
                          timeout: float | None = _UNSET) -> pb.LoraAdapter:
        """AdminService.LoadLoraAdapter (admin token): load a PEFT adapter directory that the
        server can read; requests may then name it (lora_name=...)."""
        req = pb.LoadLoraAdapterRequest(lora_name=lora_name, lora_path=lora_path)
        return self._unary(self.admin_stub.LoadLoraAdapter, req, timeout).adapter

    def unload_lora_adapter(self, lora_name: str, *, timeout: float | None = _UNSET) -> None:
        """AdminService.UnloadLoraAdapter (admin token); FailedPrecondition while it is in use."""
        self._unary(self.admin_stub.UnloadLoraAdapter, pb.UnloadLoraAdapterRequest(lora_name=lora_name), timeout)

    def model_info(self, *, timeout: float | None = _UNSET) -> pb.GetModelInfoResponse:
        return self._unary(self.stub.GetModelInfo, pb.GetModelInfoRequest(), timeout)

    def server_info(self, *, timeout: float | None = _UNSET) -> pb.GetServerInfoResponse:
        return self._unary(self.stub.GetServerInfo, pb.GetServerInfoRequest(), timeout)

    def health(self, service: str = "", *, timeout: float | None = _UNSET) -> str:
        """grpc.health.v1 Check: "SERVING", "NOT_SERVING", ... (NotFound for an unknown service)."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc  # only needed here

        stub = health_pb2_grpc.HealthStub(self._channel)
        resp = self._unary(stub.Check, health_pb2.HealthCheckRequest(service=service), timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)

    def health_watch(self, service: str = "", *, timeout: float | None = None) -> Iterator[str]:
        """grpc.health.v1 Watch: yields the status name on every change until cancelled."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        call = health_pb2_grpc.HealthStub(self._channel).Watch(
            health_pb2.HealthCheckRequest(service=service), **self._kw(timeout))
        try:
            for resp in call:
                yield health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None
        finally:
            call.cancel()

    def close(self) -> None:
        self._closed = True
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
