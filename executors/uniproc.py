"""UniprocExecutor: the worker runs in this process (no IPC)."""
from __future__ import annotations

import logging
import time

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
        logger.info("executor uniproc started on %s in %.1fs", self.worker.device, time.perf_counter() - t0)

    def determine_num_kv_blocks(self) -> int:
        return self.worker.determine_num_kv_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.worker.initialize_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)

    def execute_stats(self) -> dict:
        """The worker's {"num_steps", "execute_time_s"} (benchmarks: IPC overhead = driver time - this)."""
        return self.worker.execute_stats()

    def check_health(self) -> None:
        return None  # in-process: if we are running, the worker is alive

    def shutdown(self) -> None:
        self.worker.shutdown()
