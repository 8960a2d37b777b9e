"""The engine's gauges and counters for /metrics, read from a snapshot at each scrape.

`EngineCollector` turns an `EngineSnapshot` (the engine's last stats and the server's state,
taken when Prometheus scrapes) into metric families; nothing here runs between scrapes.
"""
from __future__ import annotations

import logging
from typing import Callable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from llmsvc.outputs import EngineStats

logger = logging.getLogger("llmsvc.server.metrics")
# Prometheus counter name, help, EngineStats.extra key (only with a swap space)
SWAP_COUNTERS = (("num_swap_outs", "Requests preempted by swapping their KV blocks out to host memory", "swap_outs"),
                 ("num_swap_ins", "Swapped requests whose KV blocks were copied back", "swap_ins"),
                 ("blocks_swapped_out", "KV blocks copied to host memory (swap-outs, host-tier stores)",
                  "blocks_swapped_out"),
                 ("blocks_swapped_in", "KV blocks copied back from host memory (swap-ins, host-tier hits)",
                  "blocks_swapped_in"),
                 ("host_tier_hits", "Prefix blocks served from the host tier instead of recomputed",
                  "host_tier_hits"))



class EngineSnapshot:
    """What the engine collector reads at scrape time (plain values; no engine call). The
    counters count from `counters_from` (the engine's totals after the server's warm-up)."""

    def __init__(self, stats: EngineStats | None = None, ready: bool = False, draining: bool = False,
                 healthy: bool = False, counters_from: EngineStats | None = None) -> None:
        self.stats = stats if stats is not None else EngineStats()
        self.ready, self.draining, self.healthy = ready, draining, healthy
        self.counters_from = counters_from if counters_from is not None else EngineStats()


class EngineCollector(Collector):
    """Engine gauges and counters, sampled on each scrape from `source()`."""

    def __init__(self, source: Callable[[], EngineSnapshot]) -> None:
        self.source = source

    def describe(self):
        return list(self._families(EngineSnapshot()))

    def collect(self):
        try:
            snap = self.source()
        except Exception:  # noqa: BLE001 - a scrape never fails because of the engine
            logger.exception("engine metrics sampling failed")
            snap = EngineSnapshot()
        return list(self._families(snap))

    @staticmethod
    def _families(snap: EngineSnapshot):
        s = snap.stats
        gauges = (("num_requests_running", "Requests running in the engine", s.num_running),
                  ("num_requests_waiting", "Requests waiting to be scheduled", s.num_waiting),
                  ("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0..1)", s.kv_cache_usage),
                  ("prefix_cache_hit_rate", "Prompt tokens served from the prefix cache (0..1)",
                   s.prefix_cache_hit_rate),
                  ("num_kv_blocks", "KV cache blocks in total", s.num_kv_blocks),
                  ("num_free_kv_blocks", "KV cache blocks free", s.num_free_kv_blocks),
                  ("server_ready", "1 once the model is loaded and warmed up", int(snap.ready)),
                  ("server_draining", "1 while shutting down", int(snap.draining)),
                  ("engine_healthy", "1 while the engine loop runs", int(snap.healthy)))
        for name, doc, value in gauges:
            yield GaugeMetricFamily("llmsvc_" + name, doc, value=float(value))
        b = snap.counters_from
        counters = (("prompt_tokens_computed", "Prompt tokens the model computed (prefix-cache hits excluded, "
                     "recomputation after preemption included)", s.prompt_tokens_total - b.prompt_tokens_total),
                    ("num_preemptions", "Requests preempted (KV cache full)", s.num_preemptions - b.num_preemptions),
                    ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                     s.extra.get("prefix_cache_queries", 0) - b.extra.get("prefix_cache_queries", 0)),
                    ("prefix_cache_hits", "Prompt tokens found in the prefix cache",
                     s.extra.get("prefix_cache_hits", 0) - b.extra.get("prefix_cache_hits", 0)))
        if "num_swap_blocks" in s.extra:  # a swap space (llmsvc/core/swap.py)
            yield GaugeMetricFamily("llmsvc_num_requests_swapped", "Requests swapped out to host memory",
                                    value=float(s.extra["num_swapped"]))
            counters += tuple((name, doc, s.extra.get(key, 0) - b.extra.get(key, 0)) for name, doc, key in SWAP_COUNTERS)
        for name, doc, value in counters:
            yield CounterMetricFamily("llmsvc_" + name, doc, value=float(value))
        spec = s.spec_decode
        if spec is not None:
            for name, doc, value in (("num_drafts", "Drafts verified (one request's draft tokens of one step)",
                                      spec.num_drafts),
                                     ("num_draft_tokens", "Draft tokens verified", spec.num_draft_tokens),
                                     ("num_accepted_tokens", "Draft tokens accepted", spec.num_accepted_tokens)):
                yield CounterMetricFamily("llmsvc_spec_decode_" + name, doc, value=float(value))
            per_pos = CounterMetricFamily("llmsvc_spec_decode_num_accepted_tokens_per_pos",
                                          "Drafts whose token at this position was accepted", labels=["position"])
            for i, value in enumerate(spec.accepted_per_pos):
                per_pos.add_metric([str(i)], float(value))
            yield per_pos
