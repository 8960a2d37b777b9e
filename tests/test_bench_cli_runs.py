"""`llmsvc bench` end to end on a tiny model: offline and served runs, the prefix-cache comparison,
and the exit status of a run whose requests failed."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from llmsvc.bench.metrics import RequestRecord, summarize

ROOT = Path(__file__).resolve().parents[1]


def test_a_run_with_failed_requests_exits_1_and_counts_them(tmp_path):
    """Throughput over requests the server refused measures nothing: the run says so in its exit
    status. Here the tiny model's context (256) cannot hold the output length the run asks for."""
    from tests.server_harness import make_tiny_served_model_dir

    d = make_tiny_served_model_dir(tmp_path / "m")
    r = subprocess.run([sys.executable, "-m", "llmsvc", "bench", str(d), "--num-requests", "2", "--input-len", "8",
                        "--output-len", "1000", "--kv-cache-memory", "16MiB"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 1, r.stderr[-3000:]
    assert "FAILED 2: ['INVALID_ARGUMENT: stopping.max_tokens" in r.stdout
    assert r.stderr.splitlines()[-1] == "llmsvc bench: 2 of 2 requests failed (the FAILED lines above say why)"


def test_bench_cli_offline_and_serve_on_a_tiny_model(tmp_path):
    from tests.server_harness import make_tiny_served_model_dir

    d = make_tiny_served_model_dir(tmp_path / "m")
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    # 4 prompts of 40 tokens sharing 32 (two full blocks): with 2 in flight at a time, the
    # second pair finds the first pair's prefix in the cache
    cmd = [sys.executable, "-m", "llmsvc", "bench", str(d), "--num-requests", "4", "--input-len", "40",
           "--shared-prefix-len", "32", "--output-len", "5", "--mode", "both", "--compare-prefix-caching",
           "--sweep-concurrency", "2", "--json", str(out), "--plot", str(png)]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())["workloads"]["custom"]
    for kind in ("offline", "serve", "serve_no_prefix_caching"):
        assert res[kind]["completed"] == 4 and res[kind]["failed"] == 0
        assert res[kind]["output_tok_s"] > 0
    assert set(res["sweep_concurrency"]) == {"2.0"}
    assert res["serve_no_prefix_caching"]["cached_prompt_tokens"] == 0
    assert res["sweep_concurrency"]["2.0"]["cached_prompt_tokens"] >= 2 * 32
    assert res["sweep_concurrency"]["2.0"]["prompt_tokens"] == 4 * 40
    assert "came from the prefix cache" in r.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "llmsvc gRPC" in r.stdout and "gRPC streaming cost" in r.stdout
    assert res["grpc_ratio"] == pytest.approx(res["serve"]["output_tok_s"] / res["offline"]["output_tok_s"])
    assert f"gRPC / in-process output tok/s: {res['grpc_ratio']:.3f}x" in r.stdout
    for rpc in ("GetServerInfo", "Tokenize"):  # probed while the serve run streamed
        assert res["rpc_latency"][rpc]["n"] >= 1 and res["rpc_latency"][rpc]["p99"] > 0
    assert "GetServerInfo alongside" in r.stdout
    for kind in ("offline", "serve"):  # the engine's queue and prefill times, over gRPC from FinishInfo.timing
        q, p = res[kind]["engine_queue_s"], res[kind]["engine_prefill_s"]
        assert 0 <= q["p50"] <= q["p99"] and 0 < p["p50"] <= p["p99"]
        assert p["p99"] < res[kind]["ttft_s"]["p99"] + 1e-3
    assert "TTFT inside the engine: queue p50" in r.stdout


def test_server_mode_rejects_compare_prefix_caching_and_tolerates_no_tokens():
    """--compare-prefix-caching needs servers started with caching off: against --server it
    would compare the cache with itself. A run in which no request got a token summarizes."""
    r = subprocess.run([sys.executable, "-m", "llmsvc", "bench", "--server", "127.0.0.1:1",
                        "--compare-prefix-caching"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "cannot be used with --server" in r.stderr
    s = summarize([RequestRecord(10, 0.0, [], 0.0, error="UNAVAILABLE: loading")], wall_s=1.0)
    assert s["completed"] == 0 and s["failed"] == 1 and s["output_tok_s"] == 0
    assert s["prefill_tok_s"] == 0.0


def test_offline_compare_prefix_caching_reruns_offline(tmp_path):
    """--mode offline --compare-prefix-caching compares two in-process engines (it used to
    start a server for the no-cache run and divide the offline prefill rate by that)."""
    from tests.server_harness import make_tiny_served_model_dir

    d = make_tiny_served_model_dir(tmp_path / "m")
    out = tmp_path / "r.json"
    r = subprocess.run([sys.executable, "-m", "llmsvc", "bench", str(d), "--num-requests", "4",
                        "--input-len", "40", "--shared-prefix-len", "32", "--output-len", "3",
                        "--mode", "offline", "--compare-prefix-caching",
                        "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())["workloads"]["custom"]
    assert "serve" not in res and "serve_no_prefix_caching" not in res
    assert res["offline_no_prefix_caching"]["cached_prompt_tokens"] == 0
    assert res["offline"]["prefill_tok_s"] > 0 and res["offline_no_prefix_caching"]["prefill_tok_s"] > 0
    assert "llmsvc offline, no prefix cache" in r.stdout


def test_compare_quantization_takes_turns_with_the_run_as_given(tmp_path, caplog, capsys):
    """--compare-quantization int8: our engine quantized is one more system in the turns, so
    --repeat alternates it with the run as given, and the ratios are of the medians. In process,
    so that the quantized engines' load is seen to quantize."""
    import argparse

    from llmsvc.bench import cli
    from tests.server_harness import make_tiny_served_model_dir

    d = make_tiny_served_model_dir(tmp_path / "m")
    out = tmp_path / "r.json"
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    a = p.parse_args([str(d), "--num-requests", "3", "--input-len", "20", "--output-len", "4", "--mode", "offline",
                      "--dtype", "bfloat16", "--compare-quantization", "int8", "--repeat", "2", "--idle-wait", "-1",
                      "--json", str(out)])
    with caplog.at_level("INFO", logger="llmsvc.models.int8_weights"):
        assert cli.main(a) == 0
    stdout = capsys.readouterr().out
    assert sum(r.getMessage().startswith("quantization int8:") for r in caplog.records) == 2  # its two runs only
    res = json.loads(out.read_text())["workloads"]["custom"]
    assert [len(res[k]) for k in ("offline_runs", "offline_int8_runs")] == [2, 2]
    assert res["offline_int8"]["completed"] == 3 and res["offline_int8"]["failed"] == 0
    ratio = res["quantization_ratio"]["offline"]
    assert ratio["quantization"] == "int8"
    assert ratio["output_tok_s"] == pytest.approx(res["offline_int8"]["output_tok_s"] / res["offline"]["output_tok_s"])
    assert "offline output tok/s with --quantization int8 / none:" in stdout
    assert stdout.index("llmsvc offline [1/2]") < stdout.index("llmsvc offline, int8 [1/2]") \
        < stdout.index("llmsvc offline [2/2]")
    served = subprocess.run([sys.executable, "-m", "llmsvc", "bench", "--server", "127.0.0.1:1",
                             "--compare-quantization", "int8"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert served.returncode == 2 and "cannot be used with --server" in served.stderr
