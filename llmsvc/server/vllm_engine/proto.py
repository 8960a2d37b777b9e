"""vLLM's engine gRPC protocol as the pinned `smg-grpc-proto` package ships it (generated stubs,
imported, never retyped): `vllm.grpc.engine.VllmEngine` over `vllm_engine.proto`, with the
messages it shares with other engines (tokenizer chunks, KV events, FlushCache) in
`smg.grpc.common` (`common.proto`)."""
from __future__ import annotations

from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2, vllm_engine_pb2_grpc

SERVICE_NAME = vllm_engine_pb2.DESCRIPTOR.services_by_name["VllmEngine"].full_name  # "vllm.grpc.engine.VllmEngine"

__all__ = ["SERVICE_NAME", "common_pb2", "vllm_engine_pb2", "vllm_engine_pb2_grpc"]
