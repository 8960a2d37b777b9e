"""vLLM's engine gRPC protocol (`vllm.grpc.engine.VllmEngine`, from the pinned smg-grpc-proto
package), served by `llmsvc serve` beside llmsvc.v1 on the same port: the protocol the SMG
gateway drives workers with (docs/vllm-engine.md).

Entry points:
- `VllmEngineService(state)`: the servicer; `await service.attach(async_engine, tokenizer,
  config)` once the engine is warm (this also starts the KV-event relay), `await
  service.close(why)` to end every SubscribeKvEvents stream (a drain or shutdown: a gateway
  reads the end of that stream as "route elsewhere");
- `add_to_server(service, server)`: register it on a grpc.aio server;
- `SERVICE_NAME`: "vllm.grpc.engine.VllmEngine", for health and reflection.

One concept per module: proto (the stubs), mapper (request -> EngineRequest, errors -> this
proto's paths), responses (outputs -> chunks / completes), loads (GetLoads), kv_events (the
relay behind SubscribeKvEvents), tokenizer_bundle (GetTokenizer), servicer (the RPCs).
"""
from __future__ import annotations

from llmsvc.server.vllm_engine.proto import SERVICE_NAME, vllm_engine_pb2_grpc
from llmsvc.server.vllm_engine.servicer import VllmEngineService


def add_to_server(service: VllmEngineService, server) -> None:
    vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(service, server)


__all__ = ["SERVICE_NAME", "VllmEngineService", "add_to_server"]
