"""grpc.health.v1 (asyncio servicer, real Watch) and server reflection v1 + v1alpha."""
from __future__ import annotations

import grpc
from grpc_health.v1 import _async as health_async
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import _async as reflection_async
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

from llmsvc.v1 import llmsvc_pb2

SERVICE_NAME = llmsvc_pb2.DESCRIPTOR.services_by_name["LlmService"].full_name  # "llmsvc.v1.LlmService"
ADMIN_SERVICE_NAME = llmsvc_pb2.DESCRIPTOR.services_by_name["AdminService"].full_name
REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class _HealthServicer(health_async.HealthServicer):
    """grpcio-health-checking's servicer; Check of an unknown service says which are known
    (the library's NOT_FOUND carries no message)."""

    async def Check(self, request, context):
        known = self._server_status  # service name -> status, kept by set()
        if request.service not in known:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service[:256]!r}; "
                                f"known: {', '.join(repr(n) for n in sorted(known))}")
        return await super().Check(request, context)

    async def List(self, request, context):
        """Every known service and its status (the library leaves List unimplemented)."""
        return health_pb2.HealthListResponse(statuses={
            name: health_pb2.HealthCheckResponse(status=status)
            for name, status in self._server_status.items()})


class Health:
    """Health states: "" SERVING once the process is up; the service only when ready."""

    def __init__(self, extra_services: tuple[str, ...] = ()) -> None:
        self.servicer = _HealthServicer()
        # services that serve exactly when LlmService does (vLLM's engine protocol)
        self.services = (SERVICE_NAME, *extra_services)

    def add_to_server(self, server: grpc.aio.Server) -> None:
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, server)

    async def starting(self) -> None:
        await self.servicer.set("", SERVING)
        for name in self.services:
            await self.servicer.set(name, NOT_SERVING)

    async def ready(self) -> None:
        for name in self.services:
            await self.servicer.set(name, SERVING)

    async def not_serving(self) -> None:
        """Engine died: the services are NOT_SERVING; the process itself still answers."""
        for name in self.services:
            await self.servicer.set(name, NOT_SERVING)

    async def draining(self) -> None:
        await self.servicer.enter_graceful_shutdown()


def _add_v1_reflection_file(pool: descriptor_pool.DescriptorPool) -> None:
    """Put grpc/reflection/v1/reflection.proto into `pool`, so that the v1 service listed
    by reflection also resolves (grpcio-reflection ships only v1alpha's file). The v1 file
    is v1alpha's with the package renamed: same messages, same field numbers."""
    name = "grpc/reflection/v1/reflection.proto"
    try:
        pool.FindFileByName(name)
        return
    except KeyError:
        pass
    fdp = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(fdp)
    old, new = fdp.package, "grpc.reflection.v1"
    fdp.name, fdp.package = name, new

    def rename(messages) -> None:
        for msg in messages:
            for field in msg.field:
                if field.type_name.startswith(f".{old}."):
                    field.type_name = f".{new}." + field.type_name[len(old) + 2:]
            rename(msg.nested_type)

    rename(fdp.message_type)
    for service in fdp.service:
        for method in service.method:
            method.input_type = method.input_type.replace(f".{old}.", f".{new}.", 1)
            method.output_type = method.output_type.replace(f".{old}.", f".{new}.", 1)
    pool.Add(fdp)


def add_reflection(server: grpc.aio.Server, extra_services: tuple[str, ...] = ()) -> None:
    """Reflection for LlmService, AdminService, Health and `extra_services` (full names, whose
    descriptors are in the default pool), under v1alpha (grpcio-reflection) and v1.

    v1 and v1alpha reflection messages are wire-identical (same field numbers), so the v1
    service is the v1alpha servicer behind a v1 method name; its descriptor is served too."""
    _add_v1_reflection_file(descriptor_pool.Default())
    names = (SERVICE_NAME, ADMIN_SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             *extra_services, reflection.SERVICE_NAME, REFLECTION_V1)
    servicer = reflection_async.ReflectionServicer(names)
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)  # v1alpha
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(REFLECTION_V1, {"ServerReflectionInfo": handler}),))
