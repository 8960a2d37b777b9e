"""logit_bias: an additive bias per (row, token)."""
from __future__ import annotations

import torch

from llmsvc.worker.stages.base import LogitsStage, Phase, StepRows, register


@register
class LogitBias(LogitsStage):
    name, phase, order, fields = "logit_bias", Phase.PROCESS, 20, ("logit_bias",)

    def __init__(self, rows: torch.Tensor, tokens: torch.Tensor, values: torch.Tensor) -> None:
        self.rows, self.tokens, self.values = rows, tokens, values  # [B] long, [B] long, [B] float32

    @classmethod
    def build(cls, rows: StepRows):
        b_rows, b_toks, b_vals = [], [], []
        for i, p in enumerate(rows.params):
            for tok, val in (p.logit_bias or {}).items():
                if 0 <= tok < rows.vocab_size and val != 0.0:
                    b_rows.append(i)
                    b_toks.append(tok)
                    b_vals.append(float(val))
        return cls(rows.long(b_rows), rows.long(b_toks), rows.float(b_vals)) if b_rows else None

    def apply(self, logits: torch.Tensor) -> None:
        logits.index_put_((self.rows, self.tokens), self.values, accumulate=True)
