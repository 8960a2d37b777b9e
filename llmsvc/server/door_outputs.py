"""The engine outputs a gRPC door turns into its messages, read the same way by every door.

Streamed, each (coalesced) DELTA output is handed on as it comes; unary, the deltas are merged
and one output holding everything is handed on at the end. A request that failed in the engine
is an INTERNAL ServiceError, raised at its first failed output.
"""
from __future__ import annotations

from typing import AsyncIterator, Callable

import grpc

from llmsvc.engine.output_stream import merge_delta
from llmsvc.outputs import RequestOutput
from llmsvc.server.errors import ServiceError


async def door_outputs(gen: AsyncIterator[RequestOutput], stream: bool,
                       observe: Callable[[RequestOutput], None] | None = None) -> AsyncIterator[RequestOutput]:
    """`gen`: AsyncEngine.generate's outputs; `observe` sees every output as it arrives (metrics,
    loads), also when unary ones are merged."""
    final = None
    async for out in gen:
        if out.error:
            raise ServiceError(grpc.StatusCode.INTERNAL, f"request failed in the engine: {out.error}",
                               reason="ENGINE_ERROR")
        if observe is not None:
            observe(out)
        if stream:
            yield out
        elif final is None:
            final = out
        else:
            merge_delta(final, out)
    if final is not None:
        yield final
