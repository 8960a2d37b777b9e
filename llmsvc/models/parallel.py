"""Tensor-parallel state for model code.

The TP group is the default torch.distributed process group: the worker (or the TP
executor) calls `torch.distributed.init_process_group` before building the model; with
no process group every rank query answers rank 0 of world size 1 and the collectives
are no-ops returning their input.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_tp_rank() -> int:
    return dist.get_rank() if _initialized() else 0


def get_tp_world_size() -> int:
    return dist.get_world_size() if _initialized() else 1


def divide(numerator: int, denominator: int) -> int:
    if numerator % denominator:
        raise ValueError(f"{numerator} is not divisible by {denominator}")
    return numerator // denominator


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum of x over all TP ranks (in place when world size > 1); returns the result."""
    if get_tp_world_size() == 1:
        return x
    dist.all_reduce(x)
    return x


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenation of every rank's x along `dim`, rank order; every rank gets the result."""
    world = get_tp_world_size()
    if world == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x)
    return torch.cat(parts, dim=dim)
