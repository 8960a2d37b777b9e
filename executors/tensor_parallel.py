"""TensorParallelExecutor: N worker processes, one rank each, torch.distributed between them
(gloo on CPU, NCCL on CUDA). Rank 0 receives each step and broadcasts it; only rank 0 samples."""
from __future__ import annotations

from executors.multiproc import MultiprocExecutor
from llmsvc.config import EngineConfig


class TensorParallelExecutor(MultiprocExecutor):
    name = "tp"

    def __init__(self, config: EngineConfig) -> None:
        pc = config.parallel_config
        if pc.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {pc.tensor_parallel_size}")
        if pc.tensor_parallel_size % pc.nnodes:
            raise ValueError(f"tensor_parallel_size ({pc.tensor_parallel_size}) must be a multiple of "
                             f"nnodes ({pc.nnodes})")
        super().__init__(config, world_size=pc.tensor_parallel_size)
