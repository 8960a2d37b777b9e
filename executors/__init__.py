"""Executors: how the engine core reaches the model. `create_executor` picks one by name."""
from __future__ import annotations

from executors.base import Executor, ExecutorError
from llmsvc.config import EngineConfig

EXECUTORS = ("uniproc", "multiproc", "tp")


def create_executor(config: EngineConfig) -> Executor:
    """Build the executor named by config.parallel_config.executor (implementations import lazily:
    importing this package does not import torch)."""
    pc = config.parallel_config
    name = pc.executor_kind
    if name == "tp":
        from executors.tensor_parallel import TensorParallelExecutor

        return TensorParallelExecutor(config)
    if name == "multiproc":
        from executors.multiproc import MultiprocExecutor

        return MultiprocExecutor(config)
    if name == "uniproc":
        from executors.uniproc import UniprocExecutor

        return UniprocExecutor(config)
    raise ValueError(f"unknown executor {name!r}; choose one of {', '.join(EXECUTORS)}")


__all__ = ["Executor", "ExecutorError", "create_executor", "EXECUTORS"]
