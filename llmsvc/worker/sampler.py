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
Steps 1-3 and 5 are the logits stages of llmsvc/worker/stages (phases PROCESS and TRUNCATE),
built per step only for the rows that need them.
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

from dataclasses import dataclass, field

import torch

from kernels import ops

from llmsvc.config import LOGPROBS_MODES
from llmsvc.wire import SampleLogprobs
from llmsvc.worker.sampling_metadata import SamplingMetadata
from llmsvc.worker.stages.base import take_rows


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [S] int64
    logprobs: list[SampleLogprobs | None]  # per row; None where the row asked for none
    # rows whose grammar mask and token rules (allowed_token_ids, min_tokens, bad words) left no
    # token: their sampled id is meaningless and must not be emitted
    no_token_rows: list[int] = field(default_factory=list)


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
            raw_lp = torch.log_softmax(take_rows(logits, lp_rows).float(), dim=-1)

        no_token: list[int] = []
        if md.all_greedy and not md.processors:  # plain greedy: nothing to process
            sampled = ops.argmax_rows(logits)
            processed = logits
            if owned:  # a grammar mask alone
                no_token = _rows_without_a_token(logits)
        else:
            # [S, V] float32, contiguous, ours to modify in place (raw logprobs are taken already)
            processed = logits if owned else torch.empty(logits.shape, dtype=torch.float32,
                                                         device=logits.device).copy_(logits)
            sampled, no_token = self._sample(processed, md)

        logprobs: list[SampleLogprobs | None] = [None] * md.num_rows
        if want_lp:
            lp = raw_lp if raw else torch.log_softmax(take_rows(processed, lp_rows).float(), dim=-1)
            entries = gather_logprobs(lp, sampled.index_select(0, lp_rows),
                                      md.max_num_logprobs,
                                      [md.num_logprobs[i] for i in lp_rows.tolist()])
            for i, e in zip(lp_rows.tolist(), entries):
                logprobs[i] = e
        return SamplerOutput(sampled_token_ids=sampled.to(torch.int64), logprobs=logprobs, no_token_rows=no_token)

    @staticmethod
    def _sample(logits: torch.Tensor, md: SamplingMetadata) -> tuple[torch.Tensor, list[int]]:
        """logits [S, V] float32 contiguous, modified in place into the sampled distribution.
        Returns the sampled ids and the rows the masks left without a token."""
        apply_logits_processors(logits, md)
        no_token = _rows_without_a_token(logits) if md.processors or md.grammar_rows is not None else []
        if md.all_greedy:
            return ops.argmax_rows(logits), no_token
        greedy = None if md.all_random else ops.argmax_rows(logits)
        for stage in md.truncators:
            stage.apply(logits)
        sampled = exponential_race(logits, md)
        if greedy is not None:
            sampled = torch.where(md.greedy_mask, greedy, sampled)
        return sampled, no_token


def _rows_without_a_token(logits: torch.Tensor) -> list[int]:
    """Rows of logits [S, V] that are -inf everywhere: the masks forbade every token (argmax
    there would answer token 0, which the request never allowed)."""
    return torch.nonzero(logits.amax(dim=-1) == float("-inf")).flatten().tolist()


def apply_logits_processors(logits: torch.Tensor, md: SamplingMetadata) -> None:
    """In place on logits [S, V]: the PROCESS stages (allowed_token_ids, logit bias, min_tokens and
    bad-word masks, penalties), which every row sees, greedy ones included."""
    for stage in md.processors:
        stage.apply(logits)


def _logprob_rows(md: SamplingMetadata) -> torch.Tensor:
    idx = [i for i, n in enumerate(md.num_logprobs) if n is not None]
    return torch.tensor(idx, dtype=torch.long, device=md.device)


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
