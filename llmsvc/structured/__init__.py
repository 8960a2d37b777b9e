"""Structured output (JSON Schema, regex, choice, grammar, JSON object, structural tag) on llguidance.

Torch-free, between the engine and the workers: the engine owns a StructuredOutputManager
that compiles constraints in a thread pool and, each step, packs the allowed next tokens of
every constrained sampling request into an int32 bitmask that travels to the workers with
the SchedulerOutput; the worker's sampler applies it (kernels.ops.apply_token_bitmask_).
"""
from __future__ import annotations

import importlib.util

from llmsvc.structured.errors import ConstraintError

# the StructuredOutputsParams kinds llmsvc.v1 serves (GetModelInfo.supported_constraints); the
# structural_tag kind, which only vLLM's engine proto and the offline API carry, is served beside them
SUPPORTED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


def available() -> bool:
    """Whether the grammar engine (llguidance) is installed."""
    return importlib.util.find_spec("llguidance") is not None


__all__ = ["ConstraintError", "SUPPORTED_KINDS", "available"]
