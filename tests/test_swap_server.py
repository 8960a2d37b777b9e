"""Swap space seen from outside: a live server (real LLMEngine over the fake executor) whose pool
forces swap-preemption reports swapped requests and the swap space in GetServerInfo, counts
swap-outs/ins, copied blocks and host-tier hits in /metrics, says in a request's Timing how often
it was swapped, and logs them in the periodic line; every block of both pools is free after."""
from __future__ import annotations

import threading
import time

from llmsvc.engine.stats import StatsLogger
from llmsvc.outputs import EngineStats
from llmsvc.v1 import llmsvc_pb2 as pb
from tests.server_harness import ServerThread, fake_engine_factory
from tests.test_metrics import gen, scrape, val


def test_swap_is_reported_in_server_info_metrics_and_timing():
    s = ServerThread(fake_engine_factory(num_blocks=8, block_size=4, step_delay=0.02, num_host_blocks=32),
                     metrics_port=0)
    try:
        results, infos = [], []

        def worker(i):
            req = gen(f"r{i}-", 26, stream=False, output=pb.OutputOptions(include_timing=True))
            results.append(list(s.stub.Generate(req))[-1])
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            infos.append(s.stub.GetServerInfo(pb.GetServerInfoRequest()))
            time.sleep(0.01)
        assert len(results) == 4 and all(r.finish.reason == pb.FinishInfo.REASON_LENGTH for r in results)
        assert max(i.num_swapped for i in infos) > 0, "a request was meant to be swapped out"
        swaps = [r.finish.timing.num_swaps for r in results]
        assert sum(swaps) > 0 and all(r.finish.timing.num_preemptions >= n for r, n in zip(results, swaps))
        info = s.stub.GetServerInfo(pb.GetServerInfoRequest())
        assert info.preemption_mode == "swap" and info.num_swap_blocks == 32
        assert info.num_swapped == 0 and info.num_free_swap_blocks == 32 and info.num_free_kv_blocks == 8
        m = scrape(s.server.metrics_port)
        assert val(m, "llmsvc_num_swap_outs_total") == val(m, "llmsvc_num_swap_ins_total") == sum(swaps)
        assert val(m, "llmsvc_blocks_swapped_out_total") > 0 and val(m, "llmsvc_blocks_swapped_in_total") > 0
        assert ("llmsvc_host_tier_hits_total", frozenset()) in m
        assert val(m, "llmsvc_num_requests_swapped") == 0
    finally:
        s.stop()


def test_periodic_line_shows_the_swap_space():
    stats = EngineStats(num_running=1, num_waiting=0, num_kv_blocks=8, num_free_kv_blocks=0, kv_cache_usage=1.0,
                        extra={"num_swapped": 2, "num_swap_blocks": 40, "num_free_swap_blocks": 30,
                               "host_tier_hits": 5})
    line = StatsLogger(10.0).format(stats, 1.0)
    assert "Swapped: 2 reqs, Swap space usage: 25.0%, Host-tier hits: 5 blocks" in line
    assert "Swapped" not in StatsLogger(10.0).format(EngineStats(), 1.0)


def test_cancels_and_deadlines_of_swapped_requests_leak_no_block():
    """Clients that cancel their streams or run out of deadline while requests are swapped out:
    afterwards every block of both pools is free and nothing is left swapped."""
    import grpc

    s = ServerThread(fake_engine_factory(num_blocks=8, block_size=4, step_delay=0.01, num_host_blocks=32))
    try:
        def cancel_after(i, n):
            call = s.stub.Generate(gen(f"c{i}-", 26))
            for k, _ in enumerate(call):
                if k >= n:
                    call.cancel()
                    break

        def deadline(i, seconds):
            try:
                list(s.stub.Generate(gen(f"d{i}-", 26), timeout=seconds))
            except grpc.RpcError:
                pass
        threads = [threading.Thread(target=cancel_after, args=(i, 3 + 2 * i)) for i in range(4)]
        threads += [threading.Thread(target=deadline, args=(i, 0.2 + 0.1 * i)) for i in range(3)]
        threads += [threading.Thread(target=lambda: list(s.stub.Generate(gen("keep-", 26))))]
        swapped_seen = 0
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            swapped_seen = max(swapped_seen, s.stub.GetServerInfo(pb.GetServerInfoRequest()).num_swapped)
            time.sleep(0.005)
        deadline_at = time.monotonic() + 10
        while True:  # aborts reach the core between steps
            info = s.stub.GetServerInfo(pb.GetServerInfoRequest())
            if (info.num_running, info.num_waiting, info.num_swapped) == (0, 0, 0) or time.monotonic() > deadline_at:
                break
            time.sleep(0.02)
        assert swapped_seen > 0, "requests were meant to be swapped out while clients left"
        assert (info.num_running, info.num_waiting, info.num_swapped) == (0, 0, 0)
        assert info.num_free_kv_blocks == 8 and info.num_free_swap_blocks == 32
    finally:
        s.stop()


def test_swap_flags_env_twins_and_bad_values(monkeypatch):
    import pytest

    from llmsvc import LLM
    from llmsvc.server import cli
    from tests.test_server_cli import parse

    d = cli.build_config(parse([]))
    assert (d.cache_config.swap_space_bytes, d.scheduler_config.preemption_mode) == (0, "auto")
    c = cli.build_config(parse(["--swap-space", "4GiB", "--preemption-mode", "swap"]))
    assert (c.cache_config.swap_space_bytes, c.scheduler_config.preemption_mode) == (4 << 30, "swap")
    e = cli.build_config(parse([], monkeypatch, {"LLMSVC_SWAP_SPACE": "512MiB", "LLMSVC_PREEMPTION_MODE": "recompute"}))
    assert (e.cache_config.swap_space_bytes, e.scheduler_config.preemption_mode) == (512 << 20, "recompute")
    for bad in (["--swap-space", "lots"], ["--preemption-mode", "drop"]):
        with pytest.raises(SystemExit):
            parse(bad)
    with pytest.raises(ValueError, match="--swap-space"):  # swap mode needs a swap space
        cli.build_config(parse(["--preemption-mode", "swap"], monkeypatch, {"LLMSVC_SWAP_SPACE": "0"}))
    with pytest.raises(ValueError, match="swap space"):
        LLM(model="/nonexistent", preemption_mode="swap")
