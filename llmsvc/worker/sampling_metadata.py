"""SamplingMetadata: the per-step, batched form of every sampling row's SamplingParams.

Built once per step by the model runner; rows are the requests that sample this step, in
batch order (S rows, vocabulary V). Every per-row feature carries a flag or an index of the
rows that use it, so the sampler skips whole stages when no row needs them:

    all_greedy          -> one argmax, no softmax, no noise
    penalties None      -> no penalty work; otherwise only the (row, token) pairs seen
    top_k_rows / top_p_rows / min_p_rows None -> no top-k, no sort, no min-p pass

Per-request seeds: a seeded row gets its own torch.Generator, seeded from
(seed, len(output_token_ids)) every step. Its noise therefore depends on nothing but the
request itself and how many tokens it has produced, so the same seed gives the same tokens
whatever else is in the batch, across preemption (recompute) and across processes.
Unseeded rows share `generator` (None => torch's default generator).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from llmsvc.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1


def step_seed(seed: int, num_output_tokens: int) -> int:
    """Deterministic 63-bit seed for (request seed, step); splitmix64 finaliser."""
    x = (seed * 0x9E3779B97F4A7C15 + num_output_tokens + 1) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) & ((1 << 63) - 1)


def _rows(mask: list[bool], device) -> torch.Tensor | None:
    """Index tensor of the rows where mask holds; None when no row does."""
    idx = [i for i, m in enumerate(mask) if m]
    return torch.tensor(idx, dtype=torch.long, device=device) if idx else None


@dataclass
class SamplingMetadata:
    num_rows: int  # S
    vocab_size: int  # V (the logits' width)

    # --- temperature ---------------------------------------------------------------
    temperature: torch.Tensor  # [S] float32; greedy rows hold 1.0 (never divided by 0)
    greedy_mask: torch.Tensor | None  # [S] bool; None when all rows are greedy or none is
    all_greedy: bool
    all_random: bool
    no_temperature: bool  # every random row has temperature == 1.0

    # --- truncation (each tensor is indexed by its own row index) -------------------
    top_k_rows: torch.Tensor | None  # [Sk] long; rows with 0 < top_k < V
    top_k: torch.Tensor | None  # [Sk] long
    max_top_k: int  # max over top_k (0 when top_k_rows is None)
    top_p_rows: torch.Tensor | None  # [Sp] long; rows with top_p < 1
    top_p: torch.Tensor | None  # [Sp] float32
    top_p_max_k: int  # max top_k over top_p rows when every one has a top_k, else 0
    min_p_rows: torch.Tensor | None  # [Sm] long; rows with min_p > 0
    min_p: torch.Tensor | None  # [Sm] float32

    # --- penalties, sparse: only tokens that penalised rows have seen ----------------
    penalties: "SparsePenalties | None"

    # --- additive bias and masks, sparse (row, token, value) triples ----------------
    bias_rows: torch.Tensor | None  # [B] long
    bias_tokens: torch.Tensor | None  # [B] long
    bias_values: torch.Tensor | None  # [B] float32
    mask_rows: torch.Tensor | None  # [M] long; min_tokens and bad words: (row, token) set to -inf
    mask_tokens: torch.Tensor | None  # [M] long
    allowed_rows: torch.Tensor | None  # [A] long; rows with allowed_token_ids
    disallowed: torch.Tensor | None  # [A, V] bool; True where allowed_rows[i] may not sample

    # --- randomness ------------------------------------------------------------------
    generators: dict[int, torch.Generator]  # row -> generator, seeded random rows only
    generator: torch.Generator | None  # shared by unseeded random rows

    # --- logprobs --------------------------------------------------------------------
    num_logprobs: list[int | None]  # per row: None => none, 0 => sampled only, k => + top-k
    max_num_logprobs: int | None  # None when no row asks for logprobs

    # --- structured output: rows under a grammar and the tokens each may sample ---------
    grammar_rows: torch.Tensor | None = None  # [G] long, sorted
    grammar_bitmask: torch.Tensor | None = None  # [G, W] int32, row i belongs to grammar_rows[i]

    def set_grammar_bitmask(self, row_req_ids: list[str], mask_req_ids: list[str], bitmask) -> None:
        """Take the step's grammar bitmask (numpy [len(mask_req_ids), W] int32, from the
        SchedulerOutput); row_req_ids is the request of each sampling row."""
        where = {rid: i for i, rid in enumerate(row_req_ids)}
        pairs = sorted((where[rid], k) for k, rid in enumerate(mask_req_ids) if rid in where)
        if not pairs:
            return
        device = self.temperature.device
        rows, src = zip(*pairs)
        mask = torch.from_numpy(bitmask)
        if list(src) != list(range(len(mask_req_ids))):
            mask = mask.index_select(0, torch.tensor(src, dtype=torch.long))
        self.grammar_rows = torch.tensor(rows, dtype=torch.long, device=device)
        self.grammar_bitmask = mask.to(device, non_blocking=True)

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
        f32 = dict(dtype=torch.float32, device=device)
        eos = [t for t in (eos_token_ids or []) if 0 <= t < V]

        greedy = [p.greedy for p in params]
        all_greedy = all(greedy)
        all_random = not any(greedy)
        temps = [1.0 if g else float(p.temperature) for p, g in zip(params, greedy)]
        random_rows = [i for i in range(S) if not greedy[i]]

        # truncation only matters for rows that sample
        k_mask = [not greedy[i] and 0 < params[i].top_k < V for i in range(S)]
        p_mask = [not greedy[i] and params[i].top_p < 1.0 for i in range(S)]
        m_mask = [not greedy[i] and params[i].min_p > 0.0 for i in range(S)]
        top_k_rows, top_p_rows, min_p_rows = (_rows(m, device) for m in (k_mask, p_mask, m_mask))
        top_ks = [params[i].top_k for i in range(S) if k_mask[i]]
        top_ps = [params[i].top_p for i in range(S) if p_mask[i]]
        min_ps = [params[i].min_p for i in range(S) if m_mask[i]]
        p_rows_all_k = all(k_mask[i] for i in range(S) if p_mask[i])
        top_p_max_k = max((params[i].top_k for i in range(S) if p_mask[i]), default=0)

        penalties = SparsePenalties.build(params, prompt_token_ids, output_token_ids, V, device)

        b_rows, b_toks, b_vals = [], [], []
        for i, p in enumerate(params):
            for tok, val in (p.logit_bias or {}).items():
                if 0 <= tok < V and val != 0.0:
                    b_rows.append(i)
                    b_toks.append(tok)
                    b_vals.append(float(val))

        m_rows, m_toks = [], []
        for i, p in enumerate(params):
            if len(output_token_ids[i]) < p.min_tokens:
                banned = set(t for t in p.stop_token_ids if t < V)
                if not p.ignore_eos:
                    banned.update(eos)
                m_toks.extend(sorted(banned))
                m_rows.extend([i] * len(banned))

        for i, p in enumerate(params):  # bad words: a sequence's last token where the output ends with the rest
            out = output_token_ids[i]
            for seq in p.bad_words_token_ids or ():
                k = len(seq) - 1
                if seq[-1] < V and (k == 0 or (len(out) >= k and list(out[len(out) - k:]) == seq[:-1])):
                    m_rows.append(i)
                    m_toks.append(seq[-1])

        a_rows = [i for i, p in enumerate(params) if p.allowed_token_ids]
        disallowed = None
        if a_rows:
            disallowed = torch.ones((len(a_rows), V), dtype=torch.bool, device=device)
            pairs = [(j, t) for j, i in enumerate(a_rows) for t in params[i].allowed_token_ids if 0 <= t < V]
            if pairs:
                rows_t, toks_t = zip(*pairs)
                disallowed[torch.tensor(rows_t, device=device), torch.tensor(toks_t, device=device)] = False

        gens: dict[int, torch.Generator] = {}
        for i in random_rows:
            if params[i].seed is not None:
                g = torch.Generator(device=device)
                g.manual_seed(step_seed(params[i].seed, len(output_token_ids[i])))
                gens[i] = g

        num_logprobs = [p.logprobs for p in params]
        asked = [n for n in num_logprobs if n is not None]

        def lt(xs):  # list -> long tensor, None when empty
            return torch.tensor(xs, dtype=torch.long, device=device) if xs else None

        def ft(xs):  # list -> float32 tensor, None when empty
            return torch.tensor(xs, **f32) if xs else None

        return cls(
            num_rows=S, vocab_size=V,
            temperature=torch.tensor(temps, **f32),
            greedy_mask=(None if all_greedy or all_random
                         else torch.tensor(greedy, dtype=torch.bool, device=device)),
            all_greedy=all_greedy, all_random=all_random,
            no_temperature=all(temps[i] == 1.0 for i in random_rows),
            top_k_rows=top_k_rows,
            top_k=lt(top_ks), max_top_k=max(top_ks, default=0),
            top_p_rows=top_p_rows, top_p=ft(top_ps),
            top_p_max_k=top_p_max_k if p_rows_all_k else 0,
            min_p_rows=min_p_rows, min_p=ft(min_ps),
            penalties=penalties,
            bias_rows=lt(b_rows), bias_tokens=lt(b_toks),
            bias_values=ft(b_vals),
            mask_rows=lt(m_rows), mask_tokens=lt(m_toks),
            allowed_rows=lt(a_rows), disallowed=disallowed,
            generators=gens, generator=generator,
            num_logprobs=num_logprobs, max_num_logprobs=max(asked) if asked else None,
        )


@dataclass
class SparsePenalties:
    """Penalties as one entry per distinct (row, token) that a penalised row has seen.

    Repetition applies to tokens seen in the prompt OR the output, presence and frequency
    to output tokens only (count 0 for prompt-only entries makes them no-ops), as in vLLM.
    Work per step is O(tokens seen by penalised rows), never O(S * V).
    """

    flat_index: torch.Tensor  # [N] long: row * V + token, into logits.view(-1)
    output_count: torch.Tensor  # [N] float32: occurrences in the row's output
    repetition: torch.Tensor  # [N] float32: the row's repetition_penalty
    frequency: torch.Tensor  # [N] float32
    presence: torch.Tensor  # [N] float32

    @classmethod
    def build(cls, params: list[SamplingParams], prompt_token_ids: list[list[int]],
              output_token_ids: list[list[int]], V: int, device) -> "SparsePenalties | None":
        rep_rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
        out_rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0
                    or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0]
        if not out_rows:
            return None
        # prompt tokens matter only under a repetition penalty
        prompt_keys = _flat_keys([prompt_token_ids[i] for i in rep_rows], rep_rows, V)
        out_keys, out_cnt = torch.unique(
            _flat_keys([output_token_ids[i] for i in out_rows], out_rows, V), return_counts=True)
        keys = torch.unique(torch.cat([prompt_keys, out_keys]))  # [N], sorted
        if keys.numel() == 0:
            return None
        count = torch.zeros(keys.shape[0], dtype=torch.float32)
        count[torch.searchsorted(keys, out_keys)] = out_cnt.float()
        row = keys // V

        def per_entry(name: str) -> torch.Tensor:
            vals = torch.tensor([getattr(p, name) for p in params], dtype=torch.float32)
            return vals[row].to(device)

        return cls(flat_index=keys.to(device), output_count=count.to(device),
                   repetition=per_entry("repetition_penalty"),
                   frequency=per_entry("frequency_penalty"),
                   presence=per_entry("presence_penalty"))


def _flat_keys(token_lists: list[list[int]], rows: list[int], V: int) -> torch.Tensor:
    """row * V + token for every token of every listed row ([sum len] long, CPU); ids
    outside [0, V) are dropped."""
    toks = torch.tensor(list(itertools.chain.from_iterable(token_lists)), dtype=torch.long)
    row = torch.repeat_interleave(torch.tensor(rows, dtype=torch.long),
                                  torch.tensor([len(t) for t in token_lists], dtype=torch.long))
    ok = (toks >= 0) & (toks < V)
    return (row * V + toks)[ok]
