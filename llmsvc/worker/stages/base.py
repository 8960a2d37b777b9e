"""LogitsStage: one step of the sampler's logits processing, and the registry of them.

A stage is built per step from the rows that sample (`StepRows`) and edits logits [S, V]
(float32, contiguous, the sampler's own copy) in place. `build` returns None when no row of the
step needs the stage, so the sampler does no work for a feature nobody uses.

Two phases, in this order (as vLLM v1's sampler):
- PROCESS: runs on every row before greedy rows take their argmax, so it may change what a
  greedy row picks (token masks, bias, penalties).
- TRUNCATE: runs after, on random rows only, and shapes the distribution they are sampled from
  (temperature, then min_p, top_k, top_p).
Within a phase, stages run by `order`. A stage names the SamplingParams fields it reads
(`fields`), so that a test can hold every declared sampling field to a stage.

Stages register themselves with `@register`; every module of this package is imported by the
package, so a new stage is one new file.
"""
from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

from llmsvc.sampling_params import SamplingParams


class Phase(enum.IntEnum):
    PROCESS = 0
    TRUNCATE = 1


@dataclass
class StepRows:
    """The rows that sample this step (S of them), in batch order."""

    params: list[SamplingParams]
    prompt_token_ids: list[list[int]]
    output_token_ids: list[list[int]]  # each row's output so far
    vocab_size: int  # V, the logits' width
    device: torch.device
    greedy: list[bool]
    eos_token_ids: list[int]  # already within [0, V)

    def long(self, xs: list[int]) -> torch.Tensor:
        return torch.tensor(xs, dtype=torch.long, device=self.device)

    def float(self, xs: list[float]) -> torch.Tensor:
        return torch.tensor(xs, dtype=torch.float32, device=self.device)

    def rows_where(self, mask: list[bool]) -> torch.Tensor | None:
        """Index tensor of the rows where mask holds; None when no row does."""
        idx = [i for i, m in enumerate(mask) if m]
        return self.long(idx) if idx else None


class LogitsStage(ABC):
    name: ClassVar[str]
    phase: ClassVar[Phase]
    order: ClassVar[int]
    fields: ClassVar[tuple[str, ...]]  # the SamplingParams fields it reads

    @classmethod
    @abstractmethod
    def build(cls, rows: StepRows) -> "LogitsStage | None":
        """This step's instance, or None when no row needs the stage."""

    @abstractmethod
    def apply(self, logits: torch.Tensor) -> None:
        """Edit logits [S, V] float32 in place."""


_REGISTRY: list[type[LogitsStage]] = []


def register(cls: type[LogitsStage]) -> type[LogitsStage]:
    if any(s.name == cls.name for s in _REGISTRY):
        raise ValueError(f"a logits stage named {cls.name!r} is registered already")
    _REGISTRY.append(cls)
    _REGISTRY.sort(key=lambda s: (s.phase, s.order))
    return cls


def registered(phase: Phase | None = None) -> list[type[LogitsStage]]:
    """The registered stages in the order they run (of one phase, when given)."""
    return [s for s in _REGISTRY if phase is None or s.phase == phase]


def take_rows(logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The rows of logits that a stage touches; logits itself when that is every row
    (row indices are sorted and unique, so numel == S means all of them)."""
    return logits if rows.numel() == logits.shape[0] else logits.index_select(0, rows)


def put_rows(logits: torch.Tensor, rows: torch.Tensor, sub: torch.Tensor) -> None:
    """Write back what take_rows returned (after in-place or out-of-place edits)."""
    if sub is logits:
        return
    if rows.numel() == logits.shape[0]:
        logits.copy_(sub)
    else:
        logits.index_copy_(0, rows, sub)


NEG_INF = float("-inf")
