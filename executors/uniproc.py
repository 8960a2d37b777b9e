"""UniprocExecutor: the worker runs in this process (no IPC).

Synchronous steps run on the caller's thread. The first non-blocking step starts one dedicated
model thread; from then on every step runs there, in submission order, so the engine thread
schedules the next step while torch (which releases the GIL in its kernels) computes this one.
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor

from executors.base import Executor
from llmsvc.config import EngineConfig
from llmsvc.wire import ModelRunnerOutput, SchedulerOutput
from llmsvc.worker.worker import Worker

logger = logging.getLogger(__name__)


class UniprocExecutor(Executor):
    name = "uniproc"

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        t0 = time.perf_counter()
        self.worker = Worker(config)
        self.worker.init_device()
        self.worker.load_model()
        self._model_thread: ThreadPoolExecutor | None = None
        logger.info("executor uniproc started on %s in %.1fs", self.worker.device, time.perf_counter() - t0)

    def determine_num_kv_blocks(self) -> int:
        return self.worker.determine_num_kv_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.worker.initialize_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput,
                      non_block: bool = False) -> ModelRunnerOutput | Future:
        if self._model_thread is None:
            if not non_block:
                return self.worker.execute_model(scheduler_output)
            self._model_thread = ThreadPoolExecutor(1, thread_name_prefix="llmsvc-model",
                                                    initializer=self.worker.init_thread)
        future = self._model_thread.submit(self.worker.execute_model, scheduler_output)
        return future if non_block else future.result()

    def collective_rpc(self, method: str, *args):
        if self._model_thread is not None:  # after the steps in flight
            return self._model_thread.submit(getattr(self.worker, method), *args).result()
        return getattr(self.worker, method)(*args)

    def execute_stats(self) -> dict:
        """The worker's {"num_steps", "execute_time_s"} (benchmarks: IPC overhead = driver time - this)."""
        return self.worker.execute_stats()

    def check_health(self) -> None:
        return None  # in-process: if we are running, the worker is alive

    def shutdown(self) -> None:
        if self._model_thread is not None:  # let a step in flight finish before the model goes
            self._model_thread.shutdown(wait=True, cancel_futures=True)
        self.worker.shutdown()
