"""SamplingMetadata: the per-step, batched form of every sampling row's SamplingParams.

Built once per step by the model runner; rows are the requests that sample this step, in
batch order (S rows, vocabulary V). Each logits stage (llmsvc/worker/stages) that some row
needs is built here; a stage no row needs is absent, so the sampler skips it:

    all_greedy and no PROCESS stage -> one argmax, no copy, no softmax, no noise
    `processors`  -> PROCESS stages (masks, bias, penalties), on every row
    `truncators`  -> TRUNCATE stages (temperature, min_p, top_k, top_p), on random rows

Per-request seeds: a seeded row gets its own torch.Generator, seeded from
(seed, len(output_token_ids)) every step. Its noise therefore depends on nothing but the
request itself and how many tokens it has produced, so the same seed gives the same tokens
whatever else is in the batch, across preemption (recompute) and across processes.
Unseeded rows share `generator` (None => torch's default generator).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from llmsvc.sampling_params import SamplingParams
from llmsvc.worker.stages import LogitsStage, Phase, StepRows, registered

_MASK64 = (1 << 64) - 1


def step_seed(seed: int, num_output_tokens: int) -> int:
    """Deterministic 63-bit seed for (request seed, step); splitmix64 finaliser."""
    x = (seed * 0x9E3779B97F4A7C15 + num_output_tokens + 1) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) & ((1 << 63) - 1)


@dataclass
class SamplingMetadata:
    num_rows: int  # S
    vocab_size: int  # V (the logits' width)
    device: torch.device
    greedy_mask: torch.Tensor | None  # [S] bool; None when all rows are greedy or none is
    all_greedy: bool
    all_random: bool
    processors: list[LogitsStage]  # PROCESS stages this step needs, in order
    truncators: list[LogitsStage]  # TRUNCATE stages this step needs, in order

    # --- randomness ------------------------------------------------------------------
    generators: dict[int, torch.Generator]  # row -> generator, seeded random rows only
    generator: torch.Generator | None  # shared by unseeded random rows

    # --- logprobs --------------------------------------------------------------------
    num_logprobs: list[int | None]  # per row: None => none, 0 => sampled only, k => + top-k
    max_num_logprobs: int | None  # None when no row asks for logprobs

    # --- structured output: rows under a grammar and the tokens each may sample ---------
    grammar_rows: torch.Tensor | None = None  # [G] long, sorted
    grammar_bitmask: torch.Tensor | None = None  # [G, W] int32, row i belongs to grammar_rows[i]
    stages: dict[str, LogitsStage] = field(default_factory=dict)  # name -> the built stages above

    def stage(self, name: str) -> LogitsStage | None:
        """The step's stage of that name; None when no row needs it."""
        return self.stages.get(name)

    def set_grammar_bitmask(self, row_req_ids: list[str], mask_req_ids: list[str], bitmask) -> None:
        """Take the step's grammar bitmask (numpy [len(mask_req_ids), W] int32, from the
        SchedulerOutput); row_req_ids is the request of each sampling row."""
        where = {rid: i for i, rid in enumerate(row_req_ids)}
        pairs = sorted((where[rid], k) for k, rid in enumerate(mask_req_ids) if rid in where)
        if not pairs:
            return
        rows, src = zip(*pairs)
        mask = torch.from_numpy(bitmask)
        if list(src) != list(range(len(mask_req_ids))):
            mask = mask.index_select(0, torch.tensor(src, dtype=torch.long))
        self.grammar_rows = torch.tensor(rows, dtype=torch.long, device=self.device)
        self.grammar_bitmask = mask.to(self.device, non_blocking=True)

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        vocab_size: int,
        device: torch.device | str = "cpu",
        eos_token_ids: list[int] | None = None,
        generator: torch.Generator | None = None,
    ) -> "SamplingMetadata":
        """One row per params entry; prompt/output token ids are that row's so far.

        Token ids >= vocab_size in logit_bias / stop_token_ids / eos_token_ids are ignored
        (the engine rejects them at admission).
        """
        S, V = len(params), vocab_size
        assert len(prompt_token_ids) == S and len(output_token_ids) == S
        device = torch.device(device)
        greedy = [p.greedy for p in params]
        rows = StepRows(params, prompt_token_ids, output_token_ids, V, device, greedy,
                        [t for t in (eos_token_ids or []) if 0 <= t < V])
        stages = {s.name: built for s in registered() if (built := s.build(rows)) is not None}
        all_greedy, all_random = all(greedy), not any(greedy)
        gens: dict[int, torch.Generator] = {}
        for i, p in enumerate(params):
            if not greedy[i] and p.seed is not None:
                g = torch.Generator(device=device)
                g.manual_seed(step_seed(p.seed, len(output_token_ids[i])))
                gens[i] = g
        num_logprobs = [p.logprobs for p in params]
        asked = [n for n in num_logprobs if n is not None]
        return cls(
            num_rows=S, vocab_size=V, device=device,
            greedy_mask=None if all_greedy or all_random else torch.tensor(greedy, dtype=torch.bool, device=device),
            all_greedy=all_greedy, all_random=all_random,
            processors=[s for s in stages.values() if s.phase == Phase.PROCESS],
            truncators=[s for s in stages.values() if s.phase == Phase.TRUNCATE],
            generators=gens, generator=generator,
            num_logprobs=num_logprobs, max_num_logprobs=max(asked) if asked else None,
            stages=stages,
        )
