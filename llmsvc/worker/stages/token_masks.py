"""Stages that forbid tokens (logit -> -inf): allowed_token_ids, min_tokens, bad words."""
from __future__ import annotations

import torch

from llmsvc.worker.stages.base import NEG_INF, LogitsStage, Phase, StepRows, put_rows, register, take_rows


@register
class AllowedTokens(LogitsStage):
    """Rows with allowed_token_ids sample only among them."""

    name, phase, order, fields = "allowed_token_ids", Phase.PROCESS, 10, ("allowed_token_ids",)

    def __init__(self, rows: torch.Tensor, disallowed: torch.Tensor) -> None:
        self.rows = rows  # [A] long
        self.disallowed = disallowed  # [A, V] bool; True where rows[i] may not sample

    @classmethod
    def build(cls, rows: StepRows):
        a_rows = [i for i, p in enumerate(rows.params) if p.allowed_token_ids]
        if not a_rows:
            return None
        V = rows.vocab_size
        disallowed = torch.ones((len(a_rows), V), dtype=torch.bool, device=rows.device)
        pairs = [(j, t) for j, i in enumerate(a_rows) for t in rows.params[i].allowed_token_ids if 0 <= t < V]
        if pairs:
            r, t = zip(*pairs)
            disallowed[rows.long(list(r)), rows.long(list(t))] = False
        return cls(rows.long(a_rows), disallowed)

    def apply(self, logits: torch.Tensor) -> None:
        sub = take_rows(logits, self.rows)  # [A, V]
        sub.masked_fill_(self.disallowed, NEG_INF)
        put_rows(logits, self.rows, sub)


class _PairMask(LogitsStage):
    """(row, token) pairs set to -inf."""

    def __init__(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        self.rows, self.tokens = rows, tokens  # [M] long each

    def apply(self, logits: torch.Tensor) -> None:
        logits[self.rows, self.tokens] = NEG_INF


@register
class MinTokens(_PairMask):
    """Until a row has min_tokens output tokens, its stop tokens and (unless ignore_eos) EOS
    cannot be sampled."""

    name, phase, order, fields = "min_tokens", Phase.PROCESS, 30, ("min_tokens",)

    @classmethod
    def build(cls, rows: StepRows):
        m_rows, m_toks = [], []
        for i, p in enumerate(rows.params):
            if len(rows.output_token_ids[i]) < p.min_tokens:
                banned = {t for t in p.stop_token_ids if t < rows.vocab_size}
                if not p.ignore_eos:
                    banned.update(rows.eos_token_ids)
                m_toks.extend(sorted(banned))
                m_rows.extend([i] * len(banned))
        return cls(rows.long(m_rows), rows.long(m_toks)) if m_rows else None


@register
class BadWords(_PairMask):
    """A bad word's last token, where the output ends with the rest of it."""

    name, phase, order, fields = "bad_words", Phase.PROCESS, 40, ("bad_words",)

    @classmethod
    def build(cls, rows: StepRows):
        m_rows, m_toks = [], []
        for i, p in enumerate(rows.params):
            out = rows.output_token_ids[i]
            for seq in p.bad_words_token_ids or ():
                k = len(seq) - 1
                if seq[-1] < rows.vocab_size and (k == 0 or (len(out) >= k and list(out[len(out) - k:]) == seq[:-1])):
                    m_rows.append(i)
                    m_toks.append(seq[-1])
        return cls(rows.long(m_rows), rows.long(m_toks)) if m_rows else None
