"""The Executor interface: how the engine core reaches the model, wherever it runs."""
from __future__ import annotations

from abc import ABC, abstractmethod
from concurrent.futures import Future

from llmsvc.config import EngineConfig
from llmsvc.wire import ModelRunnerOutput, SchedulerOutput


class ExecutorError(RuntimeError):
    """A worker died or failed; the engine cannot continue (server maps to UNAVAILABLE)."""


class Executor(ABC):
    """Owns the workers (in this process or children). The engine owns the executor.

    Construction loads the model on every worker and returns only when all are ready.
    Calls come from one thread (the engine loop), one at a time; a non-blocking execute_model
    returns before its step ran, and steps (and any later call) still run in submission order.
    """

    name: str = "?"

    def __init__(self, config: EngineConfig) -> None:
        self.config = config

    @abstractmethod
    def determine_num_kv_blocks(self) -> int:
        """Number of KV blocks every worker can hold (min over workers)."""

    @abstractmethod
    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate `num_blocks` KV blocks on every worker and warm the model up."""

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput,
                      non_block: bool = False) -> ModelRunnerOutput | Future:
        """Run one step on every worker; return rank 0's sampled tokens.

        non_block=True (async scheduling): submit the step and return at once a
        concurrent.futures.Future of its ModelRunnerOutput. The caller hands scheduler_output
        over (it must not change it afterwards; a worker may fill its placeholders in place),
        may submit the next step before this one finished, and takes each future's result, in
        order, from the same thread. The executor owns the step until the future is done.

        Raises ExecutorError if a worker has died or failed (non_block: the future's result does)."""

    def initialize_swap_space(self, nbytes: int) -> int:
        """Allocate `nbytes` of host memory for KV blocks on every worker (the swap space, in
        blocks of the KV cache's shape; each rank holds its own heads). Returns the number of
        host blocks; raises (naming --swap-space) when the memory cannot be had."""
        return self.collective_rpc("initialize_swap_space", nbytes)

    def collective_rpc(self, method: str, *args):
        """Worker.<method>(*args) on every worker, in order with the steps submitted before it;
        rank 0's result. (LoRA adapter loading; raises ExecutorError if a worker fails.)"""
        raise NotImplementedError(f"{self.name} executor has no collective_rpc")

    @abstractmethod
    def check_health(self) -> None:
        """Raise ExecutorError if any worker is dead."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop workers and free their resources. Idempotent."""
