"""A client that has no .proto file: it learns services and messages by server reflection.

Like grpcurl: the descriptors come from the server's reflection service (grpc.reflection
v1alpha, via grpcio-reflection's ProtoReflectionDescriptorDatabase) into a private
DescriptorPool; message classes are built from them at run time. This module never imports the
generated llmsvc.v1 stubs.

    with grpc.insecure_channel("localhost:50051") as channel:
        rc = ReflectionClient(channel)
        for msg in rc.call("llmsvc.v1.LlmService/Generate", {"text": "Hi", "stream": True}):
            print(msg.text, end="")
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import grpc
from google.protobuf import descriptor, descriptor_pool, json_format, message_factory


class ReflectionClient:
    """Calls any method the server exposes, with messages built from reflected descriptors."""

    def __init__(self, channel: grpc.Channel):
        from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
            ProtoReflectionDescriptorDatabase,
        )

        self._channel = channel
        self._db = ProtoReflectionDescriptorDatabase(channel)
        self.pool = descriptor_pool.DescriptorPool(self._db)  # private: not the default pool

    def services(self) -> list[str]:
        """Full names of the services the server lists."""
        return list(self._db.get_services())

    def service(self, full_name: str) -> descriptor.ServiceDescriptor:
        return self.pool.FindServiceByName(full_name)

    def method(self, full_method: str) -> descriptor.MethodDescriptor:
        """"package.Service/Method" (or "package.Service.Method") -> its descriptor."""
        service_name, _, method_name = full_method.replace("/", ".").rpartition(".")
        return self.service(service_name).methods_by_name[method_name]

    def message_class(self, full_name: str) -> type:
        """A message class for a reflected type, e.g. "llmsvc.v1.GenerateRequest"."""
        return message_factory.GetMessageClass(self.pool.FindMessageTypeByName(full_name))

    def request(self, full_method: str, fields: Mapping[str, Any] | None = None):
        """The method's input message, filled from a JSON-like dict (proto field names)."""
        cls = message_factory.GetMessageClass(self.method(full_method).input_type)
        return json_format.ParseDict(dict(fields or {}), cls(), descriptor_pool=self.pool)

    def multicallable(self, full_method: str):
        """A grpc multi-callable of the right streaming kind for the method."""
        m = self.method(full_method)
        path = f"/{m.containing_service.full_name}/{m.name}"
        output_cls = message_factory.GetMessageClass(m.output_type)
        kind = {(False, False): self._channel.unary_unary, (False, True): self._channel.unary_stream,
                (True, False): self._channel.stream_unary, (True, True): self._channel.stream_stream}
        factory = kind[(m.client_streaming, m.server_streaming)]
        return factory(path, request_serializer=lambda msg: msg.SerializeToString(),
                       response_deserializer=output_cls.FromString)

    def call(self, full_method: str, fields: Mapping[str, Any] | None = None, **call_kwargs):
        """Invoke a unary-request method: returns the response, or an iterator of them for a
        server-streaming method. call_kwargs go to grpc (timeout, metadata, ...)."""
        m = self.method(full_method)
        if m.client_streaming:
            raise ValueError(f"{full_method} is client-streaming; use multicallable()")
        return self.multicallable(full_method)(self.request(full_method, fields), **call_kwargs)

    @staticmethod
    def to_dict(msg) -> dict[str, Any]:
        """A reflected message as a dict with proto field names."""
        return json_format.MessageToDict(msg, preserving_proto_field_name=True)
