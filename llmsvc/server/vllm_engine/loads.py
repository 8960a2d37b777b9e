"""GetLoads: the engine's load as a gateway routes by it (one SchedulerLoad: this server is one
data-parallel rank).

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

    # ---- the response ---------------------------------------------------------------------
    def response(self, stats, config, version: str) -> pb.GetLoadsResponse:
        """`stats`: the engine's EngineStats (None before the model is loaded)."""
        resp = pb.GetLoadsResponse(timestamp=datetime.now(timezone.utc).isoformat(), version=version,
                                   dp_rank_count=1)
        load = pb.SchedulerLoad(dp_rank=0, num_waiting_uncached_tokens=self.waiting_uncached_tokens)
        if stats is not None and config is not None:
            block_size = config.cache_config.block_size
            used = stats.num_kv_blocks - stats.num_free_kv_blocks
            max_seqs = config.scheduler_config.max_num_seqs
            load.MergeFrom(pb.SchedulerLoad(
                num_running_reqs=stats.num_running, num_waiting_reqs=stats.num_waiting,
                num_total_reqs=stats.num_running + stats.num_waiting, num_used_tokens=used * block_size,
                max_total_num_tokens=stats.num_kv_blocks * block_size, token_usage=stats.kv_cache_usage,
                gen_throughput=self.throughput(stats.generation_tokens_total),
                cache_hit_rate=stats.prefix_cache_hit_rate,
                utilization=stats.kv_cache_usage,  # KV usage, as vLLM's and SGLang's servicers report it
                max_running_requests=max_seqs))
        resp.loads.append(load)
        return resp
