"""Repetition, frequency and presence penalties, sparse: only the tokens penalised rows have seen.

Repetition applies to tokens seen in the prompt OR the output, presence and frequency to output
tokens only (count 0 for prompt-only entries makes them no-ops), as in vLLM. Work per step is
O(tokens seen by penalised rows), never O(S * V).
"""
from __future__ import annotations

import itertools

import torch

from llmsvc.worker.stages.base import LogitsStage, Phase, StepRows, register


@register
class Penalties(LogitsStage):
    name, phase, order = "penalties", Phase.PROCESS, 50
    fields = ("repetition_penalty", "frequency_penalty", "presence_penalty")

    def __init__(self, flat_index, output_count, repetition, frequency, presence) -> None:
        self.flat_index = flat_index  # [N] long: row * V + token, into logits.view(-1)
        self.output_count = output_count  # [N] float32: occurrences in the row's output
        self.repetition = repetition  # [N] float32: the row's repetition_penalty
        self.frequency = frequency  # [N] float32
        self.presence = presence  # [N] float32

    @classmethod
    def build(cls, rows: StepRows):
        params, V = rows.params, rows.vocab_size
        rep_rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
        out_rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0
                    or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0]
        if not out_rows:
            return None
        # prompt tokens matter only under a repetition penalty
        prompt_keys = _flat_keys([rows.prompt_token_ids[i] for i in rep_rows], rep_rows, V)
        out_keys, out_cnt = torch.unique(
            _flat_keys([rows.output_token_ids[i] for i in out_rows], out_rows, V), return_counts=True)
        keys = torch.unique(torch.cat([prompt_keys, out_keys]))  # [N], sorted
        if keys.numel() == 0:
            return None
        count = torch.zeros(keys.shape[0], dtype=torch.float32)
        count[torch.searchsorted(keys, out_keys)] = out_cnt.float()
        row = keys // V

        def per_entry(name: str) -> torch.Tensor:
            vals = torch.tensor([getattr(p, name) for p in params], dtype=torch.float32)
            return vals[row].to(rows.device)

        return cls(keys.to(rows.device), count.to(rows.device), per_entry("repetition_penalty"),
                   per_entry("frequency_penalty"), per_entry("presence_penalty"))

    def apply(self, logits: torch.Tensor) -> None:
        flat = logits.view(-1)  # logits is contiguous [S, V]
        vals = flat[self.flat_index]  # [N]
        vals = torch.where(vals > 0, vals / self.repetition, vals * self.repetition)
        vals -= self.frequency * self.output_count
        vals -= self.presence * (self.output_count > 0)
        flat[self.flat_index] = vals


def _flat_keys(token_lists: list[list[int]], rows: list[int], V: int) -> torch.Tensor:
    """row * V + token for every token of every listed row ([sum len] long, CPU); ids
    outside [0, V) are dropped."""
    toks = torch.tensor(list(itertools.chain.from_iterable(token_lists)), dtype=torch.long)
    row = torch.repeat_interleave(torch.tensor(rows, dtype=torch.long),
                                  torch.tensor([len(t) for t in token_lists], dtype=torch.long))
    ok = (toks >= 0) & (toks < V)
    return (row * V + toks)[ok]
