"""The executors by name: the one table that building an executor, `llmsvc serve --executor`
(its choices and help), GetServerInfo's `executor`, `llmsvc bench --executors` and the docs'
executor table read (tests/test_executor_registry.py keeps the docs and the flags in step).

An entry names its class as "module:Class" and imports it only when an executor is built:
every implementation imports torch, and importing `executors` (the engine, the server, the
client) must not. An executor outside this package registers itself the same way, with
`register_executor`, before the engine starts; the offline `LLM` also takes an `Executor`
subclass itself (as vLLM's `distributed_executor_backend` does).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass

from executors.base import Executor
from llmsvc.config import ParallelConfig

# built whenever tensor_parallel_size > 1, whatever executor was named: the only one that runs ranks
TENSOR_PARALLEL = "tp"


@dataclass(frozen=True)
class ExecutorEntry:
    name: str  # --executor, LLM(executor=...), ParallelConfig.executor
    target: str  # "module:Class", imported by load()
    wire_name: str  # GetServerInfoResponse.executor (a stable API value; docs/request-semantics.md)
    description: str  # where the model runs, one line for the --executor help

    def load(self) -> type[Executor]:
        module, _, cls = self.target.partition(":")
        return getattr(importlib.import_module(module), cls)


_REGISTRY: dict[str, ExecutorEntry] = {}


def register_executor(name: str, target: str, description: str, wire_name: str | None = None) -> ExecutorEntry:
    """Add (or replace) the executor `name`; `target` is "module:Class" of an Executor subclass."""
    if ":" not in target:
        raise ValueError(f"executor target must be 'module:Class', got {target!r}")
    entry = ExecutorEntry(name, target, wire_name or name, description)
    _REGISTRY[name] = entry
    return entry


def executor_names() -> tuple[str, ...]:
    """The registered names, in registration order (the built-in ones first)."""
    return tuple(_REGISTRY)


def registered() -> tuple[ExecutorEntry, ...]:
    return tuple(_REGISTRY.values())


def get_entry(name: str) -> ExecutorEntry:
    entry = _REGISTRY.get(name)
    if entry is None:
        raise ValueError(f"unknown executor {name!r}; choose one of {', '.join(_REGISTRY)}")
    return entry


def executor_class(pc: ParallelConfig) -> type[Executor]:
    """The class `pc` asks for: a class given as such (any tensor_parallel_size: it handles its
    ranks), else the registered name, tensor-parallel whenever tensor_parallel_size > 1."""
    if isinstance(pc.executor, type):
        if not issubclass(pc.executor, Executor):
            raise TypeError(f"executor class {pc.executor.__qualname__} is not a subclass of executors.base.Executor")
        return pc.executor
    return get_entry(executor_kind(pc)).load()


def executor_kind(pc: ParallelConfig) -> str:
    """The registered name of the executor `pc` builds ("tp" whenever tensor_parallel_size > 1)."""
    if isinstance(pc.executor, type):
        target = f"{pc.executor.__module__}:{pc.executor.__qualname__}"
        entry = next((e for e in _REGISTRY.values() if e.target == target), None)
        return entry.name if entry else getattr(pc.executor, "name", pc.executor.__qualname__)
    return TENSOR_PARALLEL if pc.tensor_parallel_size > 1 else pc.executor


def wire_name(pc: ParallelConfig) -> str:
    """GetServerInfoResponse.executor for `pc`: the registry's wire name of what runs; a class
    that is not registered reports its `name` attribute (inherited from the executor it extends)."""
    kind = executor_kind(pc)
    entry = _REGISTRY.get(kind)
    return entry.wire_name if entry else kind


def flag_help() -> str:
    """The executors part of --executor's help: each name and where it puts the model."""
    return "; ".join(f"{e.name} ({e.description})" for e in _REGISTRY.values())


register_executor("uniproc", "executors.uniproc:UniprocExecutor",
                  "the engine core's own process: the caller's when the core is inline")
register_executor("multiproc", "executors.multiproc:MultiprocExecutor",
                  "one spawned worker process of its own, driven over a pipe")
register_executor(TENSOR_PARALLEL, "executors.tensor_parallel:TensorParallelExecutor",
                  "--tensor-parallel-size worker processes, one rank each, joined by torch.distributed",
                  wire_name="tensor_parallel")
