"""Wrap the behaviour of a grpc.aio RpcMethodHandler, for server interceptors.

grpc.aio accepts two shapes of response-streaming behaviour: an async generator (yields the
responses) or a coroutine that calls `context.write`. `wrap_handler` keeps the shape of the
handler it wraps and reports the final status code of every call to `on_done(code)`.
"""
from __future__ import annotations

import asyncio
import inspect
import time
from typing import Awaitable, Callable

import grpc


def handler_kind(handler: grpc.RpcMethodHandler) -> str:
    return f"{'stream' if handler.request_streaming else 'unary'}_{'stream' if handler.response_streaming else 'unary'}"


def replace_behavior(handler: grpc.RpcMethodHandler, behavior: Callable) -> grpc.RpcMethodHandler:
    """The same handler (kind, (de)serialisers) with `behavior` instead of its own."""
    return handler._replace(**{handler_kind(handler): behavior})


# The client's deadline passes first: the server's copy starts when the call arrives, so a
# client that gives up at its deadline resets the stream while the server still sees a little
# time left (observed: tens of ms on a loaded box). A cancel this close to the deadline is it.
DEADLINE_SLACK_S = 0.25


def deadline_passed(context: grpc.aio.ServicerContext) -> bool:
    """Whether the call's deadline has passed, within DEADLINE_SLACK_S (False without one)."""
    remaining = context.time_remaining()
    return remaining is not None and remaining <= DEADLINE_SLACK_S


def final_code(context: grpc.aio.ServicerContext, exc: BaseException | None) -> grpc.StatusCode:
    """The status a call ended with, from its context and the exception the behaviour raised."""
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code
    if isinstance(code, int):  # some grpcio versions keep the raw integer
        return next((c for c in grpc.StatusCode if c.value[0] == code), grpc.StatusCode.UNKNOWN)
    if exc is None:
        return grpc.StatusCode.OK
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
        return grpc.StatusCode.DEADLINE_EXCEEDED if deadline_passed(context) else grpc.StatusCode.CANCELLED
    return grpc.StatusCode.UNKNOWN


def wrap_handler(handler: grpc.RpcMethodHandler,
                 on_done: Callable[[grpc.StatusCode, float], None]) -> grpc.RpcMethodHandler:
    """Call `on_done(code, seconds)` once when each call of `handler` ends (never raises into the call)."""
    inner = getattr(handler, handler_kind(handler))

    def report(context, exc, t0) -> None:
        try:
            on_done(final_code(context, exc), time.perf_counter() - t0)
        except Exception:  # noqa: BLE001 - bookkeeping must not fail an RPC
            pass

    if inspect.isasyncgenfunction(inner):
        async def gen_behavior(request, context):
            t0, exc = time.perf_counter(), None
            agen = inner(request, context)
            try:
                async for msg in agen:
                    yield msg
            except BaseException as e:
                exc = e
                raise
            finally:
                try:
                    await agen.aclose()  # closed now, not when collected: the inner cleanup aborts requests
                finally:
                    report(context, exc, t0)
        return replace_behavior(handler, gen_behavior)
    if not inspect.iscoroutinefunction(inner):  # a sync behaviour (thread pool): left as it is
        return handler

    async def behavior(request, context):
        t0, exc = time.perf_counter(), None
        try:
            return await inner(request, context)
        except BaseException as e:
            exc = e
            raise
        finally:
            report(context, exc, t0)
    return replace_behavior(handler, behavior)


def deny_handler(handler: grpc.RpcMethodHandler,
                 deny: Callable[[grpc.aio.ServicerContext], Awaitable[None]]) -> grpc.RpcMethodHandler:
    """A handler of the same kind whose every call runs `deny(context)` (which aborts) instead."""
    async def behavior(request, context):
        await deny(context)
    return replace_behavior(handler, behavior)


class _Undecodable:
    """What a guarded deserializer returns for bytes that are not the request message."""

    def __init__(self, message: str) -> None:
        self.message = message


def guard_decoding(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """The same handler, but a unary request that does not parse answers INVALID_ARGUMENT
    (grpc.aio's own answer is UNKNOWN naming a Python exception class)."""
    decode = handler.request_deserializer
    inner = getattr(handler, handler_kind(handler))
    if handler.request_streaming or decode is None or not (
            inspect.isasyncgenfunction(inner) or inspect.iscoroutinefunction(inner)):
        return handler

    def safe_decode(data: bytes):
        try:
            return decode(data)
        except Exception as e:  # noqa: BLE001 - DecodeError, or whatever a deserializer raises
            return _Undecodable(f"the request is not a valid message of this method: {e}"[:1024])

    if inspect.isasyncgenfunction(inner):
        async def gen_behavior(request, context):
            if isinstance(request, _Undecodable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
            async for msg in inner(request, context):
                yield msg
        behavior = gen_behavior
    else:
        async def behavior(request, context):
            if isinstance(request, _Undecodable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
            return await inner(request, context)
    return replace_behavior(handler, behavior)._replace(request_deserializer=safe_decode)


class DecodeGuardInterceptor(grpc.aio.ServerInterceptor):
    """guard_decoding on every method (the last interceptor: its abort is what the others see)."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        return None if handler is None else guard_decoding(handler)
