"""What the benchmark measures: summaries of request records, the RPC latency probe, and first-token
times in the offline runner."""
from __future__ import annotations

import pytest

from llmsvc.bench.metrics import RequestRecord, percentiles, summarize


def test_summary_statistics():
    assert percentiles([1, 2, 3, 4, 5])["p50"] == 3 and percentiles([])["p50"] is None
    recs = [RequestRecord(10, 0.0, [1.0, 1.5, 2.0], 2.0), RequestRecord(10, 0.0, [2.0, 3.0], 3.0),
            RequestRecord(10, 0.0, [], 0.0, error="UNAVAILABLE: x")]
    s = summarize(recs, wall_s=4.0)
    assert s["completed"] == 2 and s["failed"] == 1
    assert s["output_tok_s"] == 5 / 4.0 and s["input_tok_s"] == 20 / 4.0
    assert s["ttft_s"]["mean"] == 1.5 and s["tpot_s"]["mean"] == (0.5 + 1.0) / 2
    assert s["itl_s"]["p50"] == 0.5
    assert s["prefill_tok_s"] == 20 / 2.0  # until the last first token, at 2.0
    assert s["prompt_tokens"] == 20 and s["cached_prompt_tokens"] == 0
    recs[1].cached_tokens = 8
    assert summarize(recs, wall_s=4.0)["cached_prompt_tokens"] == 8
    assert s["engine_queue_s"]["p50"] is None  # not reported: no note, no figure
    recs[0].queue, recs[0].prefill, recs[1].queue, recs[1].prefill = 0.1, 0.5, 0.3, 0.7
    s = summarize(recs, wall_s=4.0)
    assert s["engine_queue_s"]["mean"] == pytest.approx(0.2) and s["engine_prefill_s"]["p50"] == pytest.approx(0.6)


def test_rpc_probe_summary_merges_every_run():
    from llmsvc.bench.probe import RpcProbe, merged_summary

    a, b = RpcProbe("127.0.0.1:1"), RpcProbe("127.0.0.1:1")  # never started: latencies set by hand
    a.latencies = {"GetServerInfo": [0.001, 0.002], "Tokenize": [0.004]}
    b.latencies = {"GetServerInfo": [0.010], "Tokenize": []}
    b.errors = 2
    one, both = a.summary(), merged_summary([a, b])
    assert one["GetServerInfo"]["n"] == 2 and one["errors"] == 0
    assert both["GetServerInfo"]["n"] == 3 and both["Tokenize"]["n"] == 1 and both["errors"] == 2
    assert both["GetServerInfo"]["p99"] > one["GetServerInfo"]["p99"]


def test_offline_runner_times_first_tokens_from_arrival_not_from_the_next_step():
    # a request arriving while a step runs waits for it; its TTFT includes that wait, as over gRPC
    import time

    from llmsvc.bench.runners import run_offline
    from llmsvc.outputs import CompletionOutput, RequestOutput

    class SlowEngine:  # every step 50 ms; a request gets its one token in the first step after its add
        def __init__(self):
            self.pending, self.added = [], {}

        def add_request(self, rid, prompt, params):
            self.pending.append(rid)
            self.added[rid] = time.perf_counter()

        def has_unfinished_requests(self):
            return bool(self.pending)

        def step(self):
            time.sleep(0.05)
            done, self.pending = self.pending, []
            return [RequestOutput(rid, None, [1], [CompletionOutput(0, "x", [7], finish_reason="length")], True)
                    for rid in done]

    engine = SlowEngine()
    recs, _ = run_offline(engine, [[1], [2]], 1, [0.0, 0.02])
    assert recs[1].start == pytest.approx(recs[0].start + 0.02, abs=1e-3)  # its arrival, not its add
    assert engine.added["bench-1"] - recs[1].start > 0.02  # added only after the first step ended
    assert recs[1].token_times[0] - recs[1].start > 0.07  # the wait for that step counts
