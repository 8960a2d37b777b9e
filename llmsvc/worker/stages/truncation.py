"""What random rows are sampled from: temperature, then min_p, top_k and top_p, each only on
the rows that set it (greedy rows took their argmax before this phase)."""
from __future__ import annotations

import torch

from llmsvc.worker.stages.base import NEG_INF, LogitsStage, Phase, StepRows, put_rows, register, take_rows

_TOP_P_CANDIDATES = (1024, 8192)  # top-p looks for its cut among the top 1024, then 8192, then all


@register
class Temperature(LogitsStage):
    name, phase, order, fields = "temperature", Phase.TRUNCATE, 10, ("temperature",)

    def __init__(self, temperature: torch.Tensor) -> None:
        self.temperature = temperature  # [S] float32; greedy rows hold 1.0 (never divided by 0)

    @classmethod
    def build(cls, rows: StepRows):
        temps = [1.0 if g else float(p.temperature) for p, g in zip(rows.params, rows.greedy)]
        if all(t == 1.0 for t in temps):
            return None
        return cls(rows.float(temps))

    def apply(self, logits: torch.Tensor) -> None:
        logits.div_(self.temperature.unsqueeze(1))


@register
class MinP(LogitsStage):
    """Drop tokens whose probability < min_p * (max probability of the row)."""

    name, phase, order, fields = "min_p", Phase.TRUNCATE, 20, ("min_p",)

    def __init__(self, rows: torch.Tensor, min_p: torch.Tensor) -> None:
        self.rows, self.min_p = rows, min_p  # [Sm] long, [Sm] float32

    @classmethod
    def build(cls, rows: StepRows):
        mask = [not g and p.min_p > 0.0 for p, g in zip(rows.params, rows.greedy)]
        idx = rows.rows_where(mask)
        return None if idx is None else cls(idx, rows.float([p.min_p for p, m in zip(rows.params, mask) if m]))

    def apply(self, logits: torch.Tensor) -> None:
        sub = take_rows(logits, self.rows)  # [Sm, V]
        probs = sub.softmax(dim=-1)
        thresh = self.min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)  # [Sm, 1]
        sub.masked_fill_(probs < thresh, NEG_INF)
        put_rows(logits, self.rows, sub)


def _top_k_mask(rows: StepRows) -> list[bool]:
    return [not g and 0 < p.top_k < rows.vocab_size for p, g in zip(rows.params, rows.greedy)]


@register
class TopK(LogitsStage):
    """Keep the k largest logits of each row (ties with the k-th are kept)."""

    name, phase, order, fields = "top_k", Phase.TRUNCATE, 30, ("top_k",)

    def __init__(self, rows: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> None:
        self.rows, self.top_k, self.max_top_k = rows, top_k, max_top_k  # [Sk] long, [Sk] long

    @classmethod
    def build(cls, rows: StepRows):
        mask = _top_k_mask(rows)
        idx = rows.rows_where(mask)
        if idx is None:
            return None
        ks = [p.top_k for p, m in zip(rows.params, mask) if m]
        return cls(idx, rows.long(ks), max(ks))

    def apply(self, logits: torch.Tensor) -> None:
        sub = take_rows(logits, self.rows)  # [Sk, V]
        top = sub.topk(self.max_top_k, dim=-1).values  # [Sk, max_k], descending
        thresh = top.gather(1, (self.top_k - 1).unsqueeze(1))  # [Sk, 1], the k-th largest
        sub.masked_fill_(sub < thresh, NEG_INF)
        put_rows(logits, self.rows, sub)


@register
class TopP(LogitsStage):
    """Keep the smallest set of most likely tokens whose probability mass is >= top_p.

    Token j (in descending order) survives iff the mass strictly before it is < top_p; ties
    with the last survivor survive too. The cut is looked for among the most likely
    _TOP_P_CANDIDATES tokens first (partial top-k); only rows whose cut lies deeper go on
    to the next tier, and a full sort is the last one.
    """

    name, phase, order, fields = "top_p", Phase.TRUNCATE, 40, ("top_p",)

    def __init__(self, rows: torch.Tensor, top_p: torch.Tensor, max_k: int) -> None:
        self.rows, self.top_p = rows, top_p  # [Sp] long, [Sp] float32
        self.max_k = max_k  # max top_k over these rows when every one has a top_k (<= ~top_k survivors), else 0

    @classmethod
    def build(cls, rows: StepRows):
        mask = [not g and p.top_p < 1.0 for p, g in zip(rows.params, rows.greedy)]
        idx = rows.rows_where(mask)
        if idx is None:
            return None
        k_mask = _top_k_mask(rows)
        all_k = all(k_mask[i] for i, m in enumerate(mask) if m)
        max_k = max((p.top_k for p, m in zip(rows.params, mask) if m), default=0) if all_k else 0
        return cls(idx, rows.float([p.top_p for p, m in zip(rows.params, mask) if m]), max_k)

    def apply(self, logits: torch.Tensor) -> None:
        sub = take_rows(logits, self.rows)  # [Sp, V]
        probs = sub.softmax(dim=-1)
        p = self.top_p.unsqueeze(1)  # [Sp, 1]
        V = probs.shape[1]
        thresh = torch.empty_like(p)  # [Sp, 1]
        todo = None  # rows still undecided (None: all)
        for c in sorted({min(c, V) for c in (self.max_k or V, *_TOP_P_CANDIDATES, V)}):
            rows_p = probs if todo is None else probs.index_select(0, todo)
            cand = rows_p.topk(c, dim=-1).values  # [Sx, c], descending
            cut, covered = _top_p_cut(cand, p if todo is None else p.index_select(0, todo))
            if c == V:
                covered.fill_(True)  # the whole vocabulary decides every row
            done = covered.nonzero().squeeze(1)
            dst = done if todo is None else todo.index_select(0, done)
            thresh.index_copy_(0, dst, cut.index_select(0, done))
            if bool(covered.all()):
                break
            todo = (~covered).nonzero().squeeze(1) if todo is None else todo[~covered]
        sub.masked_fill_(probs < thresh, NEG_INF)
        put_rows(logits, self.rows, sub)


def _top_p_cut(desc: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """desc [R, C] probabilities sorted descending (the C largest), p [R, 1].

    Returns the probability of the last survivor [R, 1] and whether the C candidates hold
    enough mass to decide the cut [R].
    """
    cum = desc.cumsum(dim=-1)
    num_keep = ((cum - desc) < p).sum(dim=-1, keepdim=True)  # >= 1 since p > 0
    return desc.gather(1, num_keep - 1), cum[:, -1] >= p.squeeze(1)
