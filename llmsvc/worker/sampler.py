"""Sampler: one batched call per step turns logits [S, V] into one token per row.

Order of operations (as vLLM v1):
    1. allowed_token_ids: the others -> -inf       -- rows that set it
       logit_bias (additive)                       -- rows with a bias
    2. min_tokens: EOS / stop_token_ids -> -inf    -- rows with len(output) < min_tokens
       bad words: a sequence's last token -> -inf   -- where the output ends with the rest
    3. penalties                                   -- rows with a non-neutral penalty
         repetition: tokens seen in prompt OR output: logit > 0 -> logit / r, else logit * r
         frequency:  logit -= f * count_in_output
         presence:   logit -= p * (count_in_output > 0)
    4. greedy rows (temperature < 1e-5): argmax here; nothing below changes them
    5. temperature, then min_p, top_k, top_p (each only on the rows that set it)
    6. random rows: exponential race, argmax(probs / E) with E ~ Exp(1) drawn from the row's
       own generator when seeded (see SamplingMetadata), which is an exact draw from probs.

Structured output comes first of all (step 0): tokens a row's grammar forbids get -inf
(kernels.ops.apply_token_bitmask_, one batched op over the constrained rows), so every later
stage, logprobs included, sees only the tokens the grammar allows.

Logprobs follow vLLM's default `logprobs_mode="raw_logprobs"`: log_softmax of the model's
raw logits (after the grammar mask), before bias, penalties, temperature and truncation;
the rank of the sampled token (1-based, ties count against it) and the top-k are taken in
that same distribution.
`Sampler(logprobs_mode="processed_logprobs")` reports the distribution actually sampled
from instead (after step 5; for greedy rows after step 3).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import ops

from llmsvc.config import LOGPROBS_MODES
from llmsvc.wire import SampleLogprobs
from llmsvc.worker.sampling_metadata import SamplingMetadata

_NEG_INF = float("-inf")
_TOP_P_CANDIDATES = (1024, 8192)  # top-p looks for its cut among the top 1024, then 8192, then all


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [S] int64
    logprobs: list[SampleLogprobs | None]  # per row; None where the row asked for none


class Sampler:
    """Stateless; all per-request state arrives in SamplingMetadata."""

    def __init__(self, logprobs_mode: str = "raw_logprobs") -> None:
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {logprobs_mode!r}")
        self.logprobs_mode = logprobs_mode

    def __call__(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        return self.forward(logits, md)

    def forward(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        """logits [S, V] (any float dtype, not modified). Returns one token id per row."""
        assert logits.dim() == 2 and logits.shape[0] == md.num_rows, (logits.shape, md.num_rows)
        assert logits.shape[1] == md.vocab_size, (logits.shape, md.vocab_size)
        want_lp = md.max_num_logprobs is not None
        raw = self.logprobs_mode == "raw_logprobs"
        lp_rows = _logprob_rows(md) if want_lp else None
        owned = False  # whether logits is our own float32 copy (the caller's stays untouched)
        if md.grammar_rows is not None:
            logits = logits.to(torch.float32, copy=True)  # [S, V]
            ops.apply_token_bitmask_(logits, md.grammar_bitmask, md.grammar_rows)
            owned = True

        raw_lp = None
        if want_lp and raw:
            raw_lp = torch.log_softmax(_take(logits, lp_rows).float(), dim=-1)

        if md.all_greedy and md.penalties is None and md.bias_rows is None \
                and md.mask_rows is None and md.allowed_rows is None:  # plain greedy: nothing to process
            sampled = ops.argmax_rows(logits)
            processed = logits
        else:
            # [S, V] float32, contiguous, ours to modify in place (raw logprobs are taken already)
            processed = logits if owned else torch.empty(logits.shape, dtype=torch.float32,
                                                         device=logits.device).copy_(logits)
            sampled = self._sample(processed, md)

        logprobs: list[SampleLogprobs | None] = [None] * md.num_rows
        if want_lp:
            lp = raw_lp if raw else torch.log_softmax(_take(processed, lp_rows).float(), dim=-1)
            entries = gather_logprobs(lp, sampled.index_select(0, lp_rows),
                                      md.max_num_logprobs,
                                      [md.num_logprobs[i] for i in lp_rows.tolist()])
            for i, e in zip(lp_rows.tolist(), entries):
                logprobs[i] = e
        return SamplerOutput(sampled_token_ids=sampled.to(torch.int64), logprobs=logprobs)

    @staticmethod
    def _sample(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """logits [S, V] float32 contiguous, modified in place into the sampled distribution."""
        apply_logits_processors(logits, md)
        if md.all_greedy:
            sampled = ops.argmax_rows(logits)
        else:
            greedy = None if md.all_random else ops.argmax_rows(logits)
            if not md.no_temperature:
                logits.div_(md.temperature.unsqueeze(1))
            apply_min_p(logits, md)
            apply_top_k(logits, md)
            apply_top_p(logits, md)
            sampled = exponential_race(logits, md)
            if greedy is not None:
                sampled = torch.where(md.greedy_mask, greedy, sampled)
        return sampled


def _logprob_rows(md: SamplingMetadata) -> torch.Tensor:
    idx = [i for i, n in enumerate(md.num_logprobs) if n is not None]
    return torch.tensor(idx, dtype=torch.long, device=md.temperature.device)


def _take(logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The rows of logits that a stage touches; logits itself when that is every row
    (row indices are sorted and unique, so numel == S means all of them)."""
    return logits if rows.numel() == logits.shape[0] else logits.index_select(0, rows)


def _put(logits: torch.Tensor, rows: torch.Tensor, sub: torch.Tensor) -> None:
    """Write back what _take returned (after in-place or out-of-place edits)."""
    if sub is logits:
        return
    if rows.numel() == logits.shape[0]:
        logits.copy_(sub)
    else:
        logits.index_copy_(0, rows, sub)


def apply_logits_processors(logits: torch.Tensor, md: SamplingMetadata) -> None:
    """In place on logits [S, V]: allowed_token_ids, logit bias, min_tokens masking, penalties."""
    if md.allowed_rows is not None:
        sub = _take(logits, md.allowed_rows)  # [A, V]
        sub.masked_fill_(md.disallowed, _NEG_INF)
        _put(logits, md.allowed_rows, sub)
    if md.bias_rows is not None:
        logits.index_put_((md.bias_rows, md.bias_tokens), md.bias_values, accumulate=True)
    if md.mask_rows is not None:
        logits[md.mask_rows, md.mask_tokens] = _NEG_INF
    pen = md.penalties
    if pen is not None:
        flat = logits.view(-1)  # logits is contiguous [S, V]
        vals = flat[pen.flat_index]  # [N]
        vals = torch.where(vals > 0, vals / pen.repetition, vals * pen.repetition)
        vals -= pen.frequency * pen.output_count
        vals -= pen.presence * (pen.output_count > 0)
        flat[pen.flat_index] = vals


def apply_min_p(logits: torch.Tensor, md: SamplingMetadata) -> None:
    """Drop tokens whose probability < min_p * (max probability of the row)."""
    if md.min_p_rows is None:
        return
    sub = _take(logits, md.min_p_rows)  # [Sm, V]
    probs = sub.softmax(dim=-1)
    thresh = md.min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)  # [Sm, 1]
    sub.masked_fill_(probs < thresh, _NEG_INF)
    _put(logits, md.min_p_rows, sub)


def apply_top_k(logits: torch.Tensor, md: SamplingMetadata) -> None:
    """Keep the k largest logits of each row (ties with the k-th are kept)."""
    if md.top_k_rows is None:
        return
    sub = _take(logits, md.top_k_rows)  # [Sk, V]
    top = sub.topk(md.max_top_k, dim=-1).values  # [Sk, max_k], descending
    thresh = top.gather(1, (md.top_k - 1).unsqueeze(1))  # [Sk, 1], the k-th largest
    sub.masked_fill_(sub < thresh, _NEG_INF)
    _put(logits, md.top_k_rows, sub)


def apply_top_p(logits: torch.Tensor, md: SamplingMetadata) -> None:
    """Keep the smallest set of most likely tokens whose probability mass is >= top_p.

    Token j (in descending order) survives iff the mass strictly before it is < top_p; ties
    with the last survivor survive too. The cut is looked for among the most likely
    _TOP_P_CANDIDATES tokens first (partial top-k); only rows whose cut lies deeper go on
    to the next tier, and a full sort is the last one.
    """
    if md.top_p_rows is None:
        return
    sub = _take(logits, md.top_p_rows)  # [Sp, V]
    probs = sub.softmax(dim=-1)
    p = md.top_p.unsqueeze(1)  # [Sp, 1]
    V = probs.shape[1]
    thresh = torch.empty_like(p)  # [Sp, 1]
    todo = None  # rows still undecided (None: all)
    # rows that also set top_k have at most ~top_k survivors: try those first
    tiers = sorted({min(c, V) for c in (md.top_p_max_k or V, *_TOP_P_CANDIDATES, V)})
    for c in tiers:
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
    sub.masked_fill_(probs < thresh, _NEG_INF)
    _put(logits, md.top_p_rows, sub)


def _top_p_cut(desc: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """desc [R, C] probabilities sorted descending (the C largest), p [R, 1].

    Returns the probability of the last survivor [R, 1] and whether the C candidates hold
    enough mass to decide the cut [R].
    """
    cum = desc.cumsum(dim=-1)
    num_keep = ((cum - desc) < p).sum(dim=-1, keepdim=True)  # >= 1 since p > 0
    return desc.gather(1, num_keep - 1), cum[:, -1] >= p.squeeze(1)


def exponential_race(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """argmax(softmax(logits) / E), E ~ Exp(1) i.i.d.: a draw from softmax(logits). [S]

    E = -log(max(U, tiny)), U ~ Uniform[0, 1): several times faster on CPU than
    exponential_(), and E is finite and > 0, so a zero-probability token never wins.
    """
    probs = logits.softmax(dim=-1)  # [S, V]
    noise = torch.empty_like(probs)
    if len(md.generators) < md.num_rows:
        noise.uniform_(generator=md.generator)
    for row, gen in md.generators.items():
        noise[row].uniform_(generator=gen)
    noise.clamp_min_(torch.finfo(noise.dtype).tiny).log_().neg_()
    return ops.argmax_rows(probs.div_(noise))


def gather_logprobs(lp: torch.Tensor, token_ids: torch.Tensor, max_k: int,
                    ks: list[int | None] | None = None) -> list[SampleLogprobs]:
    """lp [R, V] log-probabilities, token_ids [R]: one SampleLogprobs per row.

    Row r gets the top ks[r] entries (default max_k for every row); rank is 1-based, the
    number of tokens whose logprob is >= the chosen one's.
    """
    tok_lp = lp.gather(1, token_ids.unsqueeze(1))  # [R, 1]
    ranks = (lp >= tok_lp).sum(dim=-1).tolist()
    tok_lp = tok_lp.squeeze(1).tolist()
    top_ids: list[list[int]] = [[] for _ in ranks]
    top_lps: list[list[float]] = [[] for _ in ranks]
    if max_k > 0:
        top = lp.topk(min(max_k, lp.shape[1]), dim=-1)  # [R, k], descending
        top_ids, top_lps = top.indices.tolist(), top.values.tolist()
    out = []
    for r in range(len(ranks)):
        k = max_k if ks is None else (ks[r] or 0)
        out.append(SampleLogprobs(logprob=tok_lp[r], rank=ranks[r],
                                  top_token_ids=top_ids[r][:k], top_logprobs=top_lps[r][:k]))
    return out


def compute_prompt_logprobs(logits: torch.Tensor, target_ids: torch.Tensor,
                            k: int) -> list[SampleLogprobs]:
    """logits [P, V] at prompt positions, target_ids [P] the next prompt token of each.

    Raw log_softmax (no sampling parameters apply to prompt logprobs, as in vLLM).
    """
    if logits.shape[0] == 0:
        return []
    lp = torch.log_softmax(logits.float(), dim=-1)
    return gather_logprobs(lp, target_ids.to(device=lp.device, dtype=torch.long), k)
