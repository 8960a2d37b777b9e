"""llmsvc.v1.AdminService: operator actions (Drain, FlushCache), apart from inference.

Authorization is the admin tokens' (auth.py: a BearerTokenInterceptor guarding only this
service). With no admin token configured every call ends PERMISSION_DENIED here, so a server
started without `--admin-token-file` / LLMSVC_ADMIN_TOKENS cannot be drained or flushed over
the network by anyone.

The servicer owns nothing: Drain goes to the server's `begin_drain` (the same graceful shutdown
as SIGTERM), FlushCache to the AsyncEngine, whose engine thread runs it between two steps.
"""
from __future__ import annotations

import logging
import math
from typing import Callable

import grpc

from llmsvc.engine.async_engine import AsyncEngine
from llmsvc.server import errors
from llmsvc.server.errors import ServiceError
from llmsvc.v1 import llmsvc_pb2 as pb
from llmsvc.v1 import llmsvc_pb2_grpc as pb_grpc

logger = logging.getLogger("llmsvc.server")

# begin_drain(grace or None) -> (already draining, grace in force)
DrainFn = Callable[[float | None], tuple[bool, float]]


class AdminService(pb_grpc.AdminServiceServicer):
    def __init__(self, enabled: bool, begin_drain: DrainFn, engine: Callable[[], AsyncEngine | None]) -> None:
        self.enabled = enabled
        self._begin_drain = begin_drain
        self._engine = engine

    async def _check_enabled(self, context) -> None:
        if not self.enabled:
            await errors.abort(context, ServiceError(
                grpc.StatusCode.PERMISSION_DENIED,
                "admin RPCs are off: start the server with --admin-token-file or LLMSVC_ADMIN_TOKENS",
                reason="ADMIN_DISABLED"))

    async def Drain(self, request, context):
        await self._check_enabled(context)
        grace = request.grace_seconds if request.HasField("grace_seconds") else None
        if grace is not None and not (math.isfinite(grace) and grace >= 0):
            await errors.abort(context, errors.invalid("grace_seconds", f"must be finite and >= 0, got {grace}"))
        ae = self._engine()
        stats = ae.get_stats() if ae is not None else None
        already, in_force = self._begin_drain(grace)
        if not already:
            logger.info("Drain RPC from %s: draining with grace %.1f s", context.peer(), in_force)
        return pb.DrainResponse(num_running=stats.num_running if stats else 0,
                                num_waiting=stats.num_waiting if stats else 0,
                                already_draining=already, grace_seconds=in_force)

    async def _engine_call(self, context, method: str, *args):
        """AsyncEngine.<method>(*args) for an admin call; every failure ends the call with its
        status (a loading, stopped or dead engine: UNAVAILABLE)."""
        await self._check_enabled(context)
        ae = self._engine()
        if ae is None:
            await errors.abort(context, errors.unavailable("model is loading; retry shortly", reason="LOADING"))
        try:
            return await getattr(ae, method)(*args)
        except Exception as e:  # noqa: BLE001 - LoRAAdminError, EngineDeadError... map to their status
            await errors.abort(context, e)

    async def FlushCache(self, request, context):
        flushed = await self._engine_call(context, "reset_prefix_cache")
        if not flushed:
            await errors.abort(context, ServiceError(
                grpc.StatusCode.FAILED_PRECONDITION,
                "requests hold KV blocks; flush the prefix cache when the server is idle",
                reason="KV_BLOCKS_IN_USE"))
        logger.info("FlushCache RPC from %s: prefix cache emptied", context.peer())
        return pb.FlushCacheResponse()

    async def LoadLoraAdapter(self, request, context):
        entry = await self._engine_call(context, "add_lora", request.lora_name, request.lora_path)
        logger.info("LoadLoraAdapter RPC from %s: %s from %s", context.peer(), entry.name, entry.path)
        return pb.LoadLoraAdapterResponse(adapter=pb.LoraAdapter(name=entry.name, path=entry.path, rank=entry.rank))

    async def UnloadLoraAdapter(self, request, context):
        await self._engine_call(context, "remove_lora", request.lora_name)
        logger.info("UnloadLoraAdapter RPC from %s: %s", context.peer(), request.lora_name)
        return pb.UnloadLoraAdapterResponse()
