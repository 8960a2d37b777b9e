"""Speculative decoding on the engine side: draft tokens by prompt lookup (vLLM's "ngram"
method) and the acceptance counters (torch-free). The worker verifies the drafts (wire.py).

A request whose text repeats what it has seen (code edits, quoting, extraction, a template it
fills in) continues a sequence already present in its own tokens. The proposer takes the
request's last n tokens, n from prompt_lookup_max down to prompt_lookup_min (the longest suffix
that recurs wins), finds their most recent earlier occurrence, and proposes the tokens that
followed it. When the occurrence is so recent that the continuation runs into the suffix itself
(a loop with a period shorter than the draft), the drafts continue the loop: draft j copies
position i + n + j of the sequence extended by the drafts before it.

The search is bytes.rfind over the tokens packed as int32, so it runs in C: a few microseconds
for a 4k-token request.
"""
from __future__ import annotations

from array import array

from llmsvc.config import SpeculativeConfig
from llmsvc.core.draft_governor import DraftGovernor
from llmsvc.core.request import Request
from llmsvc.outputs import SpecDecodeStats

_W = 4  # bytes per packed token id


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.k = config.num_speculative_tokens
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def propose(self, token_ids: list[int], max_drafts: int | None = None) -> list[int]:
        """Up to min(k, max_drafts) draft tokens to follow token_ids ([] when no suffix of
        min_n..max_n tokens occurred earlier). token_ids holds known ids only."""
        k = self.k if max_drafts is None else min(self.k, max_drafts)
        N = len(token_ids)
        if k <= 0 or N <= self.min_n:
            return []
        buf = array("i", token_ids).tobytes()
        for n in range(min(self.max_n, N - 1), self.min_n - 1, -1):
            start = _rfind_aligned(buf, buf[(N - n) * _W:], (N - 1) * _W)
            if start is None:
                continue
            drafts: list[int] = []
            for j in range(start + n, start + n + k):  # j < N + len(drafts) always holds
                drafts.append(token_ids[j] if j < N else drafts[j - N])
            return drafts
        return []


class Speculator:
    """What the scheduler asks: may this step draft, and which drafts for a request; and the
    counters over every verified draft (one request's draft tokens of one step)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.proposer = NgramProposer(config)
        self.governor = DraftGovernor() if config.adaptive else None
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * config.num_speculative_tokens  # [k]: drafts whose token i was accepted

    def enabled(self, num_running: int) -> bool:
        """Whether this step drafts: under disable_by_batch_size, and where the governor finds
        that drafts pay at this batch size."""
        limit = self.config.disable_by_batch_size
        allowed = limit is None or num_running <= limit
        return allowed if self.governor is None else self.governor.should_draft(num_running, allowed)

    def scheduled(self, drafted: bool, decode_only: bool) -> None:
        if self.governor is not None:
            self.governor.scheduled(drafted, decode_only)

    def step_done(self, num_tokens: int, seconds: float) -> None:
        if self.governor is not None:
            self.governor.step_done(num_tokens, seconds)

    def propose(self, req: Request, budget: int, max_len: int) -> list[int]:
        """Drafts for a decoding request: as many as the step's token budget, its max_tokens and
        its context leave room for (each accepted draft is one more output token and position);
        none under a grammar (its bitmask covers one position)."""
        if req.structured is not None:
            return []
        room = min(budget, max_len - req.num_tokens) - 1
        if req.max_tokens is not None:
            room = min(room, req.max_tokens - req.num_output_tokens - 1)
        return self.proposer.propose(req.all_token_ids, room) if room > 0 else []

    def stats(self) -> SpecDecodeStats:
        return SpecDecodeStats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                               list(self.accepted_per_pos))

    def observe(self, req: Request, num_draft_tokens: int, num_accepted: int) -> None:
        """One verified draft of `req`: the engine-wide counters and the request's own move
        together, so the per-request counts summed over every request are the engine's."""
        req.num_draft_tokens += num_draft_tokens
        req.num_accepted_tokens += num_accepted
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1


def _rfind_aligned(buf: bytes, pattern: bytes, end: int) -> int | None:
    """Token index of the last occurrence of pattern lying wholly within buf[:end] and starting on
    a token boundary, or None."""
    while True:
        pos = buf.rfind(pattern, 0, end)
        if pos < 0:
            return None
        if pos % _W == 0:
            return pos // _W
        end = pos + len(pattern) - 1  # the next search excludes this unaligned match
