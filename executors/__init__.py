"""Executors: how the engine core reaches the model. `create_executor` builds the one the
config names, from the registry (executors/registry.py)."""
from __future__ import annotations

from executors.base import Executor, ExecutorError
from executors.registry import executor_class, executor_names, register_executor
from llmsvc.config import EngineConfig


def create_executor(config: EngineConfig) -> Executor:
    """Build the executor config.parallel_config names (a registered name or an Executor
    subclass; registered implementations import lazily: importing this package does not
    import torch)."""
    return executor_class(config.parallel_config)(config)


__all__ = ["Executor", "ExecutorError", "create_executor", "executor_names", "register_executor"]
