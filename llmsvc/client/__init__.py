"""llmsvc Python stub library: sync/async clients, typed errors, CLIs. No torch, no engine.

    from llmsvc.client import Client
    with Client("localhost:50051") as c:
        print(c.generate("Hello", max_tokens=16, temperature=0.0).text)

Names are imported lazily, so `import llmsvc.client.reflection` (a client with no proto file)
does not load the generated llmsvc.v1 stubs.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "Client": "llmsvc.client.client",
    "GenerateStream": "llmsvc.client.client",
    "AsyncClient": "llmsvc.client.aio",
    "AsyncGenerateStream": "llmsvc.client.aio",
    "GenerateResult": "llmsvc.client.result",
    "Completion": "llmsvc.client.result",
    "build_generate_request": "llmsvc.client.request",
    "function_call_schema": "llmsvc.client.structured",
    "LlmsvcError": "llmsvc.client.errors",
    "InvalidArgument": "llmsvc.client.errors",
    "PromptTooLong": "llmsvc.client.errors",
    "FailedPrecondition": "llmsvc.client.errors",
    "ClientClosed": "llmsvc.client.errors",
    "NotFound": "llmsvc.client.errors",
    "AlreadyExists": "llmsvc.client.errors",
    "ResourceExhausted": "llmsvc.client.errors",
    "Unavailable": "llmsvc.client.errors",
    "DeadlineExceeded": "llmsvc.client.errors",
    "Cancelled": "llmsvc.client.errors",
    "Unauthenticated": "llmsvc.client.errors",
    "PermissionDenied": "llmsvc.client.errors",
    "Unimplemented": "llmsvc.client.errors",
    "Internal": "llmsvc.client.errors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'llmsvc.client' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
