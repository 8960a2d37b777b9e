"""llmsvc: an LLM inference engine served over gRPC.

`from llmsvc import LLM, SamplingParams` works; both are imported lazily so that `import llmsvc`
stays cheap and torch-free.
"""
from __future__ import annotations

import importlib

_LAZY = {
    "LLM": "llmsvc.llm",
    "LoRARequest": "llmsvc.llm",
    "SamplingParams": "llmsvc.sampling_params",
    "RequestOutputKind": "llmsvc.sampling_params",
    "StructuredOutputsParams": "llmsvc.sampling_params",
    "RequestOutput": "llmsvc.outputs",
    "CompletionOutput": "llmsvc.outputs",
    "EngineConfig": "llmsvc.config",
}

__all__ = list(_LAZY)  # and __version__, read when first asked for


def __getattr__(name: str):
    if name == "__version__":  # read on first use: importlib.metadata walks sys.path
        from llmsvc.version import installed_version
        return installed_version()
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'llmsvc' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
