"""StatsLogger: a periodic vLLM-like throughput / cache line.

Called after every engine step and, while the engine is idle, from the engine thread's idle
tick (about once a second), so lines keep their interval with or without traffic and the tail
of a workload is logged without waiting for the next request. Idle lines (no tokens, nothing
running or waiting) after the first are DEBUG, as vLLM's."""
from __future__ import annotations

import logging
import time

from llmsvc.outputs import EngineStats

logger = logging.getLogger("llmsvc.engine")


class StatsLogger:
    def __init__(self, interval_s: float, log=logger) -> None:
        self.interval_s = interval_s
        self.log = log
        self._last_time: float | None = None
        self._last_prompt = 0
        self._last_gen = 0
        self._last_spec = (0, 0, 0)  # drafts, draft tokens, accepted tokens at the last line
        self._last_idle = False  # the last line showed no work

    def format(self, stats: EngineStats, elapsed: float) -> str:
        prompt_tps = (stats.prompt_tokens_total - self._last_prompt) / elapsed if elapsed > 0 else 0.0
        gen_tps = (stats.generation_tokens_total - self._last_gen) / elapsed if elapsed > 0 else 0.0
        return (f"Avg prompt throughput: {prompt_tps:.1f} tokens/s, "
                f"Avg generation throughput: {gen_tps:.1f} tokens/s, "
                f"Running: {stats.num_running} reqs, Waiting: {stats.num_waiting} reqs, "
                f"KV cache usage: {100 * stats.kv_cache_usage:.1f}%, "
                f"Prefix cache hit rate: {100 * stats.prefix_cache_hit_rate:.1f}%, "
                f"Preemptions: {stats.num_preemptions}" + self._swap(stats) + self._spec_decode(stats))

    @staticmethod
    def _swap(stats: EngineStats) -> str:
        """With a swap space: requests swapped out now and the swap space in use."""
        x = stats.extra
        if "num_swap_blocks" not in x:
            return ""
        used = 1 - x["num_free_swap_blocks"] / x["num_swap_blocks"] if x["num_swap_blocks"] else 0.0
        return (f", Swapped: {x['num_swapped']} reqs, Swap space usage: {100 * used:.1f}%, "
                f"Host-tier hits: {x['host_tier_hits']} blocks")

    def _spec_decode(self, stats: EngineStats) -> str:
        """Acceptance over the interval (vLLM logs the same two figures)."""
        spec = stats.spec_decode
        if spec is None:
            return ""
        drafts, tokens, accepted = (spec.num_drafts - self._last_spec[0], spec.num_draft_tokens - self._last_spec[1],
                                    spec.num_accepted_tokens - self._last_spec[2])
        rate = 100 * accepted / tokens if tokens else 0.0
        length = 1 + accepted / drafts if drafts else 1.0
        return f", Draft acceptance rate: {rate:.1f}%, Mean acceptance length: {length:.2f}"

    def maybe_log(self, stats: EngineStats, now: float | None = None) -> str | None:
        """Log (and return) a line when `interval_s` passed since the last one; else None."""
        now = time.monotonic() if now is None else now
        if self._last_time is None:
            self._reset(stats, now)
            return None
        elapsed = now - self._last_time
        if self.interval_s <= 0 or elapsed < self.interval_s:
            return None
        line = self.format(stats, elapsed)
        idle = (stats.prompt_tokens_total == self._last_prompt and stats.generation_tokens_total == self._last_gen
                and not stats.num_running and not stats.num_waiting)
        (self.log.debug if idle and self._last_idle else self.log.info)(line)
        self._last_idle = idle
        self._reset(stats, now)
        return line

    def _reset(self, stats: EngineStats, now: float) -> None:
        self._last_time = now
        self._last_prompt = stats.prompt_tokens_total
        self._last_gen = stats.generation_tokens_total
        spec = stats.spec_decode
        self._last_spec = (0, 0, 0) if spec is None else (spec.num_drafts, spec.num_draft_tokens,
                                                          spec.num_accepted_tokens)
