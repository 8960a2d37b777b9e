"""Whether verifying drafts pays at the current batch size, measured while serving (torch-free).

A draft token costs what a decoded token costs in the step's arithmetic and pays only when it
is accepted. With one request a decode step streams the weights once for one token or five, so
drafts are nearly free; with many, a step on a CPU is bound by arithmetic and wrong drafts cost
as much as tokens (docs/spec-decode.md has the measurements). Where the crossover lies depends
on the hardware, the model and the text, so it is measured, not configured:

Decode-only steps (every scheduled request decoding, nothing admitted) are timed, and their
output tokens per second kept, per batch-size bucket (1, 2-3, 4-7, 8-15, ...), as an
exponential average for steps with drafts and one for steps without. A bucket first tries
each kind PROBE_STEPS times, then keeps the better one, and every EXPLORE_EVERY-th step of the
bucket tries the other kind again, so a change in the text or the load is noticed.

Outputs do not depend on any of this: drafts only decide how many of a request's tokens come
out of one step.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

logger = logging.getLogger(__name__)

PROBE_STEPS = 4  # steps of each kind a bucket tries before it compares them
EXPLORE_EVERY = 8  # then one step in this many tries the kind it is not using
_EMA = 0.25  # weight of the newest step in a bucket's average


@dataclass
class _Bucket:
    rate: tuple[float, float] = (0.0, 0.0)  # output tokens per second of steps (without, with) drafts
    count: tuple[int, int] = (0, 0)  # steps observed (without, with) drafts
    steps: int = 0  # decisions taken
    logged: bool | None = None  # the choice last logged (None: none yet)

    def observe(self, drafted: bool, tokens_per_second: float) -> None:
        i = int(drafted)
        rate, count = list(self.rate), list(self.count)
        rate[i] = tokens_per_second if count[i] == 0 else (1 - _EMA) * rate[i] + _EMA * tokens_per_second
        count[i] += 1
        self.rate, self.count = tuple(rate), tuple(count)


class DraftGovernor:
    def __init__(self) -> None:
        self.buckets: dict[int, _Bucket] = {}
        self._bucket = 0  # bucket of the step being scheduled (set by should_draft)
        self._pending: tuple[int, bool] | None = None  # (bucket, drafted) of the step scheduled

    @staticmethod
    def bucket_of(num_decodes: int) -> int:
        return max(num_decodes, 1).bit_length()  # 1 -> 1, 2-3 -> 2, 4-7 -> 3, ...

    def should_draft(self, num_running: int, allowed: bool = True) -> bool:
        """Whether the step about to be scheduled, with num_running requests running, drafts
        (never when not `allowed`: such a step is still timed, as one without drafts)."""
        self._bucket = self.bucket_of(num_running)
        if not allowed:
            return False
        b = self.buckets.setdefault(self._bucket, _Bucket())
        b.steps += 1
        if b.count[1] < PROBE_STEPS:
            return True
        if b.count[0] < PROBE_STEPS:
            return False
        better = b.rate[1] >= b.rate[0]
        return better if b.steps % EXPLORE_EVERY else not better

    def scheduled(self, drafted: bool, decode_only: bool) -> None:
        """The step just scheduled (after should_draft): whether any request carries drafts, and
        whether it is decode-only (only those steps are timed)."""
        self._pending = (self._bucket, drafted) if decode_only else None

    def step_done(self, num_tokens: int, seconds: float) -> None:
        """The scheduled step emitted num_tokens output tokens in `seconds` (model time)."""
        pending, self._pending = self._pending, None
        if pending is None or seconds <= 0 or num_tokens <= 0:
            return
        bucket, drafted = pending
        b = self.buckets.setdefault(bucket, _Bucket())
        b.observe(drafted, num_tokens / seconds)
        if min(b.count) >= PROBE_STEPS and (b.rate[1] >= b.rate[0]) != b.logged:
            b.logged = b.rate[1] >= b.rate[0]
            lo, hi = 1 << (bucket - 1), (1 << bucket) - 1
            logger.info("speculative decoding %s at %d-%d running requests: %.1f output tokens/s with drafts, "
                        "%.1f without", "on" if b.logged else "off", lo, hi, b.rate[1], b.rate[0])

    def drafting(self) -> dict[int, bool]:
        """Bucket -> whether it drafts now (buckets past probing only), for logs and tests."""
        return {k: b.rate[1] >= b.rate[0] for k, b in sorted(self.buckets.items())
                if min(b.count) >= PROBE_STEPS}
