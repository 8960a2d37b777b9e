"""The server answers what the proto promises: FinishInfo.seed and Timing.num_preemptions, the
GetServerInfo executor and device, min_tokens against max_model_len (real LLMEngine over the
FakeExecutor, loopback port)."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from llmsvc.config import ParallelConfig
from llmsvc.v1 import llmsvc_pb2 as pb
from tests.reliability_utils import rpc_details
from tests.server_harness import ServerThread, fake_engine_factory

ST, SP = pb.StoppingCriteria, pb.SamplingParams


def configured(factory, **fields):
    """`factory`, with EngineConfig fields replaced on the engine it builds."""
    def make():
        engine = factory()
        engine.config = engine.config.replace(**fields)
        return engine
    return make


@pytest.fixture(scope="module")
def srv():
    s = ServerThread(fake_engine_factory(num_blocks=64, max_model_len=64))
    yield s
    s.stop()


def finals(s: ServerThread, req: pb.GenerateRequest) -> dict[int, pb.GenerateResponse]:
    return {m.index: m for m in s.stub.Generate(req) if m.HasField("finish")}


def test_seed_echoed_per_index(srv):
    req = pb.GenerateRequest(text="hi", sampling=SP(n=3, seed=40, temperature=0.7), stopping=ST(max_tokens=3))
    out = finals(srv, req)
    assert [out[i].finish.seed for i in range(3)] == [40, 41, 42]  # index i samples with seed + i


def test_index_seeds_wrap_below_the_largest_seed_a_request_may_send(srv):
    top = 2 ** 63 - 1
    req = pb.GenerateRequest(text="hi", sampling=SP(n=3, seed=top, temperature=0.7), stopping=ST(max_tokens=3))
    out = finals(srv, req)
    assert [out[i].finish.seed for i in range(3)] == [top, 0, 1]  # (seed + i) mod 2^63
    again = finals(srv, pb.GenerateRequest(text="hi", sampling=SP(n=1, seed=out[1].finish.seed, temperature=0.7),
                                           stopping=ST(max_tokens=3)))
    assert list(again[0].token_ids) == list(out[1].token_ids)  # index 1's seed sent back reproduces it


def test_unseeded_sampling_echoes_the_seed_it_used(srv):
    req = pb.GenerateRequest(text="hi", sampling=SP(n=2, temperature=0.7), stopping=ST(max_tokens=3))
    out = finals(srv, req)
    assert out[0].finish.HasField("seed") and out[1].finish.HasField("seed")
    assert out[1].finish.seed == out[0].finish.seed + 1
    again = finals(srv, req)
    assert again[0].finish.seed != out[0].finish.seed  # drawn per request
    greedy = finals(srv, pb.GenerateRequest(text="hi", sampling=SP(temperature=0.0), stopping=ST(max_tokens=3)))
    assert not greedy[0].finish.HasField("seed")  # greedy samples nothing


def test_num_preemptions_reported():
    # 8 blocks of 4 tokens: two requests of 4 + 20 tokens cannot both stay resident
    with ServerThread(fake_engine_factory(num_blocks=8, max_model_len=64, max_num_seqs=2, step_delay=0.01)) as s:
        req = pb.GenerateRequest(text="abc", stopping=ST(max_tokens=20), output=pb.OutputOptions(include_timing=True))
        with ThreadPoolExecutor(2) as pool:
            results = list(pool.map(lambda r: list(s.stub.Generate(r)), [req, req]))
        counts = [m.finish.timing.num_preemptions for res in results for m in res]
        assert all(len(m.token_ids) == 20 for res in results for m in res)
        assert sum(counts) >= 1
        assert sum(counts) == s.engine.get_stats().num_preemptions  # each preemption is one request's


def test_server_info_executor_is_tensor_parallel_when_tp_size_above_one():
    factory = configured(fake_engine_factory(), parallel_config=ParallelConfig(executor="multiproc",
                                                                              tensor_parallel_size=3))
    with ServerThread(factory) as s:
        info = s.stub.GetServerInfo(pb.GetServerInfoRequest())
        assert (info.executor, info.tensor_parallel_size) == ("tensor_parallel", 3)


def test_server_info_reports_the_resolved_device(tmp_path, monkeypatch):
    from llmsvc.config import EngineConfig, ModelConfig
    from llmsvc.engine.llm_engine import LLMEngine
    from llmsvc.worker import device
    from tests.engine_fakes import FakeExecutor
    from tests.server_harness import make_tiny_served_model_dir

    monkeypatch.setattr(device.torch.cuda, "is_available", lambda: True)  # as on a GPU machine
    monkeypatch.setattr("executors.create_executor", lambda config: FakeExecutor(config, num_blocks=16))
    model_dir = make_tiny_served_model_dir(tmp_path)
    config = EngineConfig(model_config=ModelConfig(model=model_dir), device="auto", log_stats_interval_s=0.0)
    engine = LLMEngine.from_config(config)
    assert engine.config.device == "cuda" and engine.core.executor.config.device == "cuda"
    with ServerThread(lambda: engine, warmup=False) as s:
        assert s.stub.GetServerInfo(pb.GetServerInfoRequest()).device == "cuda"


def test_prompt_plus_min_tokens_at_max_model_len_is_prompt_too_long(srv):
    # max_model_len 64: a 60-token prompt leaves room for 4 tokens, so min_tokens 4 just fits and
    # min_tokens 5 is refused by the server's own rule (reason PROMPT_TOO_LONG), not the engine's
    ok = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[97] * 60), stopping=ST(min_tokens=4))
    (final,) = list(srv.stub.Generate(ok))
    assert len(final.token_ids) == 4 and final.finish.reason == pb.FinishInfo.REASON_CONTEXT
    bad = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[97] * 60), stopping=ST(min_tokens=5))
    with pytest.raises(grpc.RpcError) as e:
        list(srv.stub.Generate(bad))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    d = rpc_details(e.value)
    assert d["ErrorInfo"].reason == "PROMPT_TOO_LONG"
    assert d["ErrorInfo"].metadata["prompt_tokens"] == "60"


def _run_in_order(s: ServerThread, reqs: list[pb.GenerateRequest], gap_s: float = 0.15) -> tuple[list[str], dict]:
    """Send the requests `gap_s` apart, each from its own thread; return the order their streams
    finished and each final message by request id."""
    import threading
    import time

    done, finals_by_id = [], {}
    lock = threading.Lock()

    def one(r):
        for m in s.stub.Generate(r):
            if m.HasField("finish"):
                with lock:
                    done.append(r.request_id)
                    finals_by_id[r.request_id] = m
    threads = []
    for r in reqs:
        t = threading.Thread(target=one, args=(r,))
        t.start()
        threads.append(t)
        time.sleep(gap_s)
    for t in threads:
        t.join(60)
    return done, finals_by_id


def _req(rid: str, priority: int, max_tokens: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id=rid, text="go", priority=priority, stream=True,
                              stopping=ST(max_tokens=max_tokens), output=pb.OutputOptions(include_timing=True))


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_priority_policy_orders_waiting_requests(policy):
    # one seat: "first" runs; "later" (priority 3) and then "sooner" (priority 1) wait for it
    with ServerThread(fake_engine_factory(max_num_seqs=1, step_delay=0.01, policy=policy)) as s:
        done, out = _run_in_order(s, [_req("first", 0, 60), _req("later", 3, 3), _req("sooner", 1, 3)])
    assert done == (["first", "sooner", "later"] if policy == "priority" else ["first", "later", "sooner"])
    assert all(m.finish.timing.num_preemptions == 0 for m in out.values())  # nobody ranked below a waiter


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_priority_arrival_preempts_a_less_urgent_running_request(policy):
    with ServerThread(fake_engine_factory(max_num_seqs=1, step_delay=0.01, policy=policy)) as s:
        done, out = _run_in_order(s, [_req("batch", 5, 40), _req("urgent", -1, 3)])
    if policy == "priority":
        assert done == ["urgent", "batch"]
        assert out["batch"].finish.timing.num_preemptions == 1
    else:
        assert done == ["batch", "urgent"]
        assert out["batch"].finish.timing.num_preemptions == 0
    assert out["batch"].num_output_tokens == 40  # recomputed after preemption, nothing lost


def test_scheduling_policy_flag_and_env(monkeypatch):
    import argparse

    from llmsvc.server import cli

    def config(argv):
        p = argparse.ArgumentParser()
        cli.add_arguments(p)
        return cli.build_config(p.parse_args(argv)).scheduler_config.policy
    assert config([]) == "fcfs"
    assert config(["--scheduling-policy", "priority"]) == "priority"
    monkeypatch.setenv("LLMSVC_SCHEDULING_POLICY", "priority")
    assert config([]) == "priority"


def test_allow_listed_labels_on_metrics():
    from prometheus_client import generate_latest

    with ServerThread(fake_engine_factory(), metrics_label_keys=("tenant",)) as s:
        req = pb.GenerateRequest(text="hi", stopping=ST(max_tokens=2), labels={"tenant": "acme", "user": "u-12345"})
        list(s.stub.Generate(req))
        list(s.stub.Generate(pb.GenerateRequest(text="hi", stopping=ST(max_tokens=2))))
        text = generate_latest(s.server.metrics.registry).decode()
    assert 'llmsvc_request_success_total{finish_reason="length",tenant="acme"} 1.0' in text
    assert 'llmsvc_request_success_total{finish_reason="length",tenant=""} 1.0' in text  # no label given
    assert 'llmsvc_e2e_request_latency_seconds_count{tenant="acme"} 1.0' in text
    assert "u-12345" not in text and "user=" not in text  # not allow-listed: logs only (test_deploy_logging)


def test_metrics_label_values_are_bounded():
    from llmsvc.server.metrics import MAX_LABEL_VALUES, ServerMetrics

    m = ServerMetrics(label_keys=("tenant",))
    values = {m.label_values({"tenant": f"t{i}"})[0] for i in range(MAX_LABEL_VALUES + 50)}
    assert len(values) == MAX_LABEL_VALUES + 1 and "other" in values
    assert m.label_values({"tenant": "t0"}) == ("t0",)  # a value already seen keeps its series
    for bad in ("has-dash", "finish_reason", "__x"):
        with pytest.raises(ValueError):
            ServerMetrics(label_keys=(bad,))
