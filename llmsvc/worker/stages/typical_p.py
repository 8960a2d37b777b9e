"""typical_p: locally typical sampling (Meister et al., 2022), as transformers' TypicalLogitsWarper.

Per row: H = entropy of the distribution; each token's distance is |-log p - H|; tokens are
taken closest first until they hold typical_p of the mass (the token that crosses it is kept,
so at least one survives); the rest get -inf. Runs after min_p and before top_k / top_p.
"""
from __future__ import annotations

import torch

from llmsvc.worker.stages.base import NEG_INF, LogitsStage, Phase, StepRows, put_rows, register, take_rows


@register
class TypicalP(LogitsStage):
    name, phase, order, fields = "typical_p", Phase.TRUNCATE, 25, ("typical_p",)

    def __init__(self, rows: torch.Tensor, typical_p: torch.Tensor) -> None:
        self.rows, self.typical_p = rows, typical_p  # [St] long, [St] float32

    @classmethod
    def build(cls, rows: StepRows):
        mask = [not g and p.typical_p < 1.0 for p, g in zip(rows.params, rows.greedy)]
        idx = rows.rows_where(mask)
        return None if idx is None else cls(idx, rows.float([p.typical_p for p, m in zip(rows.params, mask) if m]))

    def apply(self, logits: torch.Tensor) -> None:
        sub = take_rows(logits, self.rows)  # [St, V]
        logp = sub.log_softmax(dim=-1)
        p = logp.exp()
        entropy = -(p * logp.nan_to_num(neginf=0.0)).sum(dim=-1, keepdim=True)  # [St, 1]
        dist = (-logp - entropy).abs()  # [St, V]; +inf where p == 0
        order = dist.argsort(dim=-1)  # closest to typical first
        mass = p.gather(1, order).cumsum(dim=-1)  # [St, V]
        keep_n = (mass < self.typical_p.unsqueeze(1)).sum(dim=-1, keepdim=True) + 1  # the crossing token too
        ranks = torch.empty_like(order).scatter_(1, order, torch.arange(order.shape[1], device=order.device)
                                                 .expand_as(order))
        sub.masked_fill_(ranks >= keep_n, NEG_INF)
        put_rows(logits, self.rows, sub)
