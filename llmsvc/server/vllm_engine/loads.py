"""GetLoads, and the load record on every KvEventBatch: the engine's load as a gateway routes by
it (one SchedulerLoad: this server is one data-parallel rank).

From the engine's stats (as of its last step): running and waiting requests, KV usage and the
tokens it stands for, the prefix-cache hit rate. Kept here:
- `gen_throughput`: generated tokens per second over the last WINDOW_S seconds of samples
  (taken at most every SAMPLE_EVERY_S, whenever loads are read);
- `num_waiting_uncached_tokens`: prompt tokens of the requests this door handed to the engine
  that have produced no output yet (an upper bound: the prefix cache may serve part of them;
  the engine does not report its queue's tokens, and requests of llmsvc.v1 are not counted).
"""
from __future__ import annotations

import time
from collections import deque
from datetime import datetime, timezone

from llmsvc.server.vllm_engine.proto import common_pb2 as cpb
from llmsvc.server.vllm_engine.proto import vllm_engine_pb2 as pb

WINDOW_S = 30.0
SAMPLE_EVERY_S = 0.5


class LoadTracker:
    def __init__(self) -> None:
        self._pending: dict[str, int] = {}  # request id -> prompt tokens, until its first output
        self._samples: deque[tuple[float, int]] = deque()  # (monotonic time, generated tokens total)

    # ---- requests of this door --------------------------------------------------------
    def submitted(self, request_id: str, num_prompt_tokens: int) -> None:
        self._pending[request_id] = num_prompt_tokens

    def started(self, request_id: str) -> None:
        """The request's first output came: its prompt is computed."""
        self._pending.pop(request_id, None)

    finished = started

    @property
    def waiting_uncached_tokens(self) -> int:
        return sum(self._pending.values())

    # ---- rates ----------------------------------------------------------------------------
    def throughput(self, generated_total: int, now: float | None = None) -> float:
        """Generated tokens per second over the window, sampling `generated_total` now."""
        now = time.monotonic() if now is None else now
        if not self._samples or now - self._samples[-1][0] >= SAMPLE_EVERY_S:
            self._samples.append((now, generated_total))
        while len(self._samples) > 2 and now - self._samples[1][0] >= WINDOW_S:
            self._samples.popleft()
        (t0, n0), (t1, n1) = self._samples[0], (now, generated_total)
        return (n1 - n0) / (t1 - t0) if t1 > t0 else 0.0

    # ---- the records ----------------------------------------------------------------------
    def _numbers(self, stats, config) -> dict:
        """What both records say, by SchedulerLoad's names (stats: the engine's EngineStats)."""
        block_size = config.cache_config.block_size
        return dict(num_running_reqs=stats.num_running, num_waiting_reqs=stats.num_waiting,
                    num_used_tokens=(stats.num_kv_blocks - stats.num_free_kv_blocks) * block_size,
                    max_total_num_tokens=stats.num_kv_blocks * block_size, token_usage=stats.kv_cache_usage,
                    gen_throughput=self.throughput(stats.generation_tokens_total),
                    cache_hit_rate=stats.prefix_cache_hit_rate,
                    max_running_requests=config.scheduler_config.max_num_seqs)

    def response(self, stats, config, version: str) -> pb.GetLoadsResponse:
        """`stats`: the engine's EngineStats (None before the model is loaded)."""
        resp = pb.GetLoadsResponse(timestamp=datetime.now(timezone.utc).isoformat(), version=version,
                                   dp_rank_count=1)
        load = pb.SchedulerLoad(dp_rank=0, num_waiting_uncached_tokens=self.waiting_uncached_tokens)
        if stats is not None and config is not None:
            n = self._numbers(stats, config)
            # utilization: KV usage, as vLLM's and SGLang's servicers report it
            load.MergeFrom(pb.SchedulerLoad(**n, num_total_reqs=n["num_running_reqs"] + n["num_waiting_reqs"],
                                            utilization=n["token_usage"]))
        resp.loads.append(load)
        return resp

    def engine_load(self, stats, config, full: bool) -> cpb.EngineLoad:
        """The load record a KvEventBatch carries (the same numbers as GetLoads); `full` adds the
        telemetry the proto sends on the heartbeat cadence only (hit rate, KV tokens)."""
        n = self._numbers(stats, config)
        load = cpb.EngineLoad(running_requests=n["num_running_reqs"], waiting_requests=n["num_waiting_reqs"],
                              waiting_uncached_tokens=self.waiting_uncached_tokens, token_usage=n["token_usage"],
                              gen_throughput=n["gen_throughput"], max_running_requests=n["max_running_requests"],
                              prefill_pending_tokens=self.waiting_uncached_tokens)
        if full:
            load.cache_hit_rate = n["cache_hit_rate"]
            load.num_used_tokens = n["num_used_tokens"]
            load.max_total_num_tokens = n["max_total_num_tokens"]
        return load
