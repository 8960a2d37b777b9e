"""Prometheus /metrics of a live server (real LLMEngine over the fake executor): the listed series
exist, and their values move with requests, cancels, errors, preemption and prefix-cache hits."""
from __future__ import annotations

import threading
import time
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from llmsvc.outputs import CompletionOutput, RequestMetrics, RequestOutput
from llmsvc.server.metrics import ServerMetrics
from llmsvc.v1 import llmsvc_pb2 as pb
from tests.server_harness import ServerThread, fake_engine_factory

GEN = ("llmsvc.v1.LlmService", "Generate")

HISTOGRAMS = ["llmsvc_time_to_first_token_seconds", "llmsvc_time_per_output_token_seconds",
              "llmsvc_e2e_request_latency_seconds", "llmsvc_request_queue_time_seconds",
              "llmsvc_request_prefill_time_seconds", "llmsvc_request_decode_time_seconds",
              "llmsvc_request_prompt_tokens", "llmsvc_request_generation_tokens"]
GAUGES = ["llmsvc_num_requests_running", "llmsvc_num_requests_waiting", "llmsvc_kv_cache_usage_perc",
          "llmsvc_prefix_cache_hit_rate", "llmsvc_num_kv_blocks", "llmsvc_num_free_kv_blocks",
          "llmsvc_server_ready", "llmsvc_server_draining", "llmsvc_engine_healthy"]
COUNTERS = ["llmsvc_prompt_tokens_total", "llmsvc_generation_tokens_total", "llmsvc_prompt_tokens_computed_total",
            "llmsvc_num_preemptions_total",
            "llmsvc_prefix_cache_queries_total", "llmsvc_prefix_cache_hits_total"]


def scrape(port: int) -> dict:
    """{(sample name, frozenset(labels)): value} from GET /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        assert r.status == 200
        text = r.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def val(samples: dict, name: str, **labels) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def grpc_count(samples: dict, code: str, service_method=GEN) -> float:
    return val(samples, "llmsvc_grpc_requests_total", service=service_method[0], method=service_method[1],
               code=code)


def wait_for(port: int, pred, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        s = scrape(port)
        if pred(s):
            return s
        assert time.monotonic() < deadline, "metrics never reached the expected values"
        time.sleep(0.02)


def gen(text: str, max_tokens: int, stream: bool = True, **kw) -> pb.GenerateRequest:
    return pb.GenerateRequest(text=text, stream=stream, stopping=pb.StoppingCriteria(max_tokens=max_tokens), **kw)


@pytest.fixture()
def srv():
    s = ServerThread(fake_engine_factory(step_delay=0.002), metrics_port=0)
    yield s
    s.stop()


def test_endpoint_exposes_every_series(srv):
    samples = scrape(srv.server.metrics_port)
    names = {n for n, _ in samples}
    for h in HISTOGRAMS:
        assert {h + "_bucket", h + "_count", h + "_sum"} <= names, h
    for n in GAUGES + COUNTERS:
        assert n in names, n
    assert val(samples, "llmsvc_server_ready") == 1 and val(samples, "llmsvc_engine_healthy") == 1
    assert val(samples, "llmsvc_num_kv_blocks") == 64 and val(samples, "llmsvc_num_free_kv_blocks") == 64
    list(srv.stub.Generate(gen("x", 1)))
    names = {n for n, _ in scrape(srv.server.metrics_port)}
    assert {"llmsvc_request_success_total", "llmsvc_grpc_requests_total"} <= names


def test_token_counters_count_the_clients_tokens_only(srv):
    # the server's warm-up request (one prompt token, one generated) is not counted
    port = srv.server.metrics_port
    start = scrape(port)
    for name in ("llmsvc_prompt_tokens_total", "llmsvc_generation_tokens_total", "llmsvc_prompt_tokens_computed_total",
                 "llmsvc_prefix_cache_queries_total"):
        assert val(start, name) == 0, name
    prompt = "counters from zero"
    n_prompt = len(srv.stub.Tokenize(pb.TokenizeRequest(text=prompt)).token_ids)
    list(srv.stub.Generate(gen(prompt, 4)))
    after = wait_for(port, lambda s: val(s, "llmsvc_generation_tokens_total") >= 4)
    assert (val(after, "llmsvc_prompt_tokens_total"), val(after, "llmsvc_generation_tokens_total")) == (n_prompt, 4)


def test_values_move_after_requests(srv):
    port = srv.server.metrics_port
    prompt = "metrics move when requests finish"
    n_prompt = len(srv.stub.Tokenize(pb.TokenizeRequest(text=prompt)).token_ids)
    before = scrape(port)
    msgs = list(srv.stub.Generate(gen(prompt, 7)))
    assert msgs[-1].finish.reason == pb.FinishInfo.REASON_LENGTH
    after = wait_for(port, lambda s: grpc_count(s, "OK") > grpc_count(before, "OK"))

    def delta(name, **labels):
        return val(after, name, **labels) - val(before, name, **labels)
    assert delta("llmsvc_request_success_total", finish_reason="length") == 1
    assert grpc_count(after, "OK") - grpc_count(before, "OK") == 1
    for h in HISTOGRAMS:
        assert delta(h + "_count") == 1, h
    assert delta("llmsvc_e2e_request_latency_seconds_sum") > 0
    assert delta("llmsvc_e2e_request_latency_seconds_sum") >= delta("llmsvc_time_to_first_token_seconds_sum")
    assert delta("llmsvc_request_generation_tokens_sum") == 7
    assert delta("llmsvc_request_prompt_tokens_sum") == n_prompt
    assert delta("llmsvc_generation_tokens_total") == 7
    assert delta("llmsvc_prompt_tokens_total") == n_prompt
    assert delta("llmsvc_prompt_tokens_computed_total") == n_prompt  # a prompt never seen: no cache hits

    probe = list(srv.stub.Generate(gen("stop early", 5, stream=False)))[-1].text
    stop = list(srv.stub.Generate(pb.GenerateRequest(
        text="stop early", stopping=pb.StoppingCriteria(max_tokens=5, stop=[probe[1]]))))
    assert stop[-1].finish.reason == pb.FinishInfo.REASON_STOP
    assert val(wait_for(port, lambda s: val(s, "llmsvc_request_success_total", finish_reason="stop") > 0),
               "llmsvc_request_success_total", finish_reason="stop") == 1

    before = scrape(port)
    with pytest.raises(grpc.RpcError) as ei:
        list(srv.stub.Generate(pb.GenerateRequest(text="bad", sampling=pb.SamplingParams(temperature=-1.0))))
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    s = wait_for(port, lambda s: grpc_count(s, "INVALID_ARGUMENT") == 1)
    for reason in ("length", "stop", "abort"):  # rejected at admission: it never finished
        assert val(s, "llmsvc_request_success_total", finish_reason=reason) == val(
            before, "llmsvc_request_success_total", finish_reason=reason)


def test_token_counters_follow_what_clients_receive(srv):
    """As vLLM's: the whole prompt even when the prefix cache holds it, and the tokens delivered,
    not those the engine made past a stop string before its abort landed."""
    port = srv.server.metrics_port
    prompt = "the same prompt twice shares its cached blocks " * 3
    n_prompt = len(srv.stub.Tokenize(pb.TokenizeRequest(text=prompt)).token_ids)
    list(srv.stub.Generate(gen(prompt, 2)))
    before = wait_for(port, lambda s: val(s, "llmsvc_generation_tokens_total") >= 2)
    list(srv.stub.Generate(gen(prompt, 2)))
    after = wait_for(port, lambda s: val(s, "llmsvc_generation_tokens_total") >= 4)
    assert val(after, "llmsvc_prompt_tokens_total") - val(before, "llmsvc_prompt_tokens_total") == n_prompt
    computed = val(after, "llmsvc_prompt_tokens_computed_total") - val(before, "llmsvc_prompt_tokens_computed_total")
    assert 0 < computed < n_prompt

    text = list(srv.stub.Generate(gen("stop counting here", 40, stream=False)))[-1].text
    delivered = 0
    for i in range(3, 6):  # stop strings a few tokens in; the engine may run ahead of the front end
        before = wait_for(port, lambda s: True)
        (m,) = list(srv.stub.Generate(pb.GenerateRequest(
            text="stop counting here", stopping=pb.StoppingCriteria(max_tokens=40, stop=[text[i]]))))
        assert m.finish.reason == pb.FinishInfo.REASON_STOP
        delivered = m.finish.usage.completion_tokens
        time.sleep(0.05)  # steps past the stop, if any, are counted by now
        after = scrape(port)
        assert val(after, "llmsvc_generation_tokens_total") - val(before, "llmsvc_generation_tokens_total") \
            == delivered, i


def test_gauges_while_running_and_cancel_counts_abort():
    s = ServerThread(fake_engine_factory(step_delay=0.02), metrics_port=0)
    try:
        port = s.server.metrics_port
        call = s.stub.Generate(gen("hold the kv cache for a while", 200))
        next(call)
        live = wait_for(port, lambda x: val(x, "llmsvc_num_requests_running") == 1)
        assert val(live, "llmsvc_kv_cache_usage_perc") > 0
        assert val(live, "llmsvc_num_free_kv_blocks") < val(live, "llmsvc_num_kv_blocks")
        call.cancel()
        done = wait_for(port, lambda x: grpc_count(x, "CANCELLED") == 1
                        and val(x, "llmsvc_num_requests_running") == 0)
        assert val(done, "llmsvc_request_success_total", finish_reason="abort") == 1
        assert val(done, "llmsvc_kv_cache_usage_perc") == 0
    finally:
        s.stop()


def test_refusals_finish_no_completion_and_ttft_counts_calls_cancelled_after_it():
    # as vLLM: request_success counts completions of requests the engine took (a call refused
    # for its id or its constraint is no "abort"), and TTFT is observed at the first token
    s = ServerThread(fake_engine_factory(step_delay=0.02), metrics_port=0)
    try:
        port = s.server.metrics_port
        held = s.stub.Generate(gen("hold on", 200, request_id="dup"))
        next(held)
        with pytest.raises(grpc.RpcError) as ei:
            list(s.stub.Generate(gen("same id", 4, request_id="dup")))
        assert ei.value.code() == grpc.StatusCode.ALREADY_EXISTS
        with pytest.raises(grpc.RpcError) as ei:
            list(s.stub.Generate(gen("bad regex", 4, sampling=pb.SamplingParams(regex="(a"))))
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        held.cancel()
        done = wait_for(port, lambda x: grpc_count(x, "CANCELLED") == 1
                        and val(x, "llmsvc_num_requests_running") == 0)
        assert val(done, "llmsvc_request_success_total", finish_reason="abort") == 1
        assert val(done, "llmsvc_time_to_first_token_seconds_count") == 1
        assert val(done, "llmsvc_e2e_request_latency_seconds_count") == 0  # finished requests only
    finally:
        s.stop()


def test_preemptions_and_prefix_cache_hits_are_counted():
    # 8 blocks of 4 tokens: four requests of ~30 tokens each cannot all stay resident
    # step_delay: a request lasts ~30 steps x 20 ms, so all four overlap and must share the pool
    s = ServerThread(fake_engine_factory(num_blocks=8, block_size=4, step_delay=0.02), metrics_port=0)
    try:
        port = s.server.metrics_port
        results = []

        def worker(i):
            results.append(list(s.stub.Generate(gen(f"r{i}-", 26, stream=False)))[-1])
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert len(results) == 4 and all(r.finish.reason == pb.FinishInfo.REASON_LENGTH for r in results)
        assert val(scrape(port), "llmsvc_num_preemptions_total") > 0

        prompt = "prefix cache hit"  # 16 tokens: 4 full blocks to share
        list(s.stub.Generate(gen(prompt, 1, stream=False)))
        before = scrape(port)
        list(s.stub.Generate(gen(prompt, 1, stream=False)))
        after = scrape(port)
        assert val(after, "llmsvc_prefix_cache_hit_rate") > 0

        def delta(name):
            return val(after, name) - val(before, name)
        # 3 of the 4 full blocks (the last prompt token is always computed) of 16 looked up
        assert (delta("llmsvc_prefix_cache_hits_total"), delta("llmsvc_prefix_cache_queries_total")) == (12, 16)
    finally:
        s.stop()


def _out(comps, finished, metrics=None):
    return RequestOutput("r", None, [1, 2, 3], comps, finished, metrics=metrics)


def test_request_tracker_n2_deltas_and_idempotent_cancel():
    m = ServerMetrics()
    t = m.track(n=2)
    t.admitted = True
    first = RequestMetrics(arrival_time=100.0, first_scheduled_time=100.5, first_token_time=101.0,
                           last_token_time=101.0)
    t.observe(_out([CompletionOutput(0, "a", [5], num_output_tokens=1),
                    CompletionOutput(1, "b", [6], num_output_tokens=1)], False, first))
    t.observe(_out([CompletionOutput(1, "c", [7], finish_reason="stop", num_output_tokens=2)], False))
    rm = RequestMetrics(arrival_time=100.0, first_scheduled_time=100.5, first_token_time=101.0,
                        last_token_time=105.0, finished_time=105.5)
    t.observe(_out([CompletionOutput(0, "d", [8] * 4, finish_reason="length", num_output_tokens=5)], True, rm))
    t.cancelled()  # after the final output: nothing more is counted
    r = m.registry
    assert r.get_sample_value("llmsvc_request_success_total", {"finish_reason": "stop"}) == 1
    assert r.get_sample_value("llmsvc_request_success_total", {"finish_reason": "length"}) == 1
    assert r.get_sample_value("llmsvc_request_success_total", {"finish_reason": "abort"}) is None
    assert r.get_sample_value("llmsvc_request_queue_time_seconds_sum") == pytest.approx(0.5)
    assert r.get_sample_value("llmsvc_time_to_first_token_seconds_sum") == pytest.approx(1.0)
    assert r.get_sample_value("llmsvc_request_prefill_time_seconds_sum") == pytest.approx(0.5)
    assert r.get_sample_value("llmsvc_request_decode_time_seconds_sum") == pytest.approx(4.0)
    assert r.get_sample_value("llmsvc_e2e_request_latency_seconds_sum") == pytest.approx(5.5)
    assert r.get_sample_value("llmsvc_time_per_output_token_seconds_sum") == pytest.approx(4.0 / 4)
    assert r.get_sample_value("llmsvc_request_generation_tokens_sum") == 7
    assert t.num_generated == 7 and t.reasons == {0: "length", 1: "stop"}

    t2 = m.track(n=3)
    t2.admitted = True
    t2.observe(_out([CompletionOutput(2, "x", [1], finish_reason="stop", num_output_tokens=1)], False))
    t2.cancelled()
    t2.cancelled()
    assert r.get_sample_value("llmsvc_request_success_total", {"finish_reason": "abort"}) == 2
    assert r.get_sample_value("llmsvc_request_success_total", {"finish_reason": "stop"}) == 2
    assert r.get_sample_value("llmsvc_e2e_request_latency_seconds_count") == 1  # only finished requests


def test_two_servers_keep_separate_registries():
    a, b = ServerMetrics(), ServerMetrics()  # the global registry would raise on duplicate names
    a.track().observe(_out([CompletionOutput(0, "", [], finish_reason="stop", num_output_tokens=1)], True))
    assert a.registry.get_sample_value("llmsvc_request_success_total", {"finish_reason": "stop"}) == 1
    assert b.registry.get_sample_value("llmsvc_request_success_total", {"finish_reason": "stop"}) is None


def test_metrics_port_off_by_default():
    s = ServerThread(fake_engine_factory(), load=False)
    try:
        assert s.server.metrics_port is None and s.server.metrics_http is None
    finally:
        s.stop()


class _EndedCall:
    """The two things final_code reads of a call's context."""

    def __init__(self, remaining):
        self.remaining = remaining

    def code(self):
        return None

    def time_remaining(self):
        return self.remaining


@pytest.mark.parametrize("remaining, code", [
    (None, grpc.StatusCode.CANCELLED), (30.0, grpc.StatusCode.CANCELLED), (-0.5, grpc.StatusCode.DEADLINE_EXCEEDED),
    # the client resets the stream at its deadline, before the server's copy (set on arrival) runs out
    (0.04, grpc.StatusCode.DEADLINE_EXCEEDED)])
def test_a_cancel_at_the_deadline_counts_as_the_deadline(remaining, code):
    import asyncio

    from llmsvc.server.rpc_wrap import final_code
    assert final_code(_EndedCall(remaining), asyncio.CancelledError()) == code
