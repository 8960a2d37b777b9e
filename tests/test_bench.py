"""The benchmark tool: the packaged standard workloads, summaries, ceiling, a tiny run."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from llmsvc.bench.ceiling import (ceiling, decode_step, kv_bytes_per_token, memory_floor, param_counts,
                                  read_bandwidth, step_floor)
from llmsvc.bench.metrics import RequestRecord, percentiles, summarize
from llmsvc.bench import cli as bench_cli
from llmsvc.bench import executors as bench_executors
from llmsvc.bench.workloads import (Workload, arrival_offsets, build_prompts, get_workload, load_workloads,
                                   ordinary_vocab)
from model_utils import make_tiny_model_dir

ROOT = Path(__file__).resolve().parents[1]


def test_standard_workloads_load():
    ws = load_workloads()
    assert {"W1", "W2", "S1", "P1"} <= set(ws)
    assert (ws["W1"].num_requests, ws["W1"].input_len, ws["W1"].output_len) == (64, 128, 128)
    assert ws["S1"].arrival == "poisson" and ws["S1"].rate == 2.0
    assert ws["P1"].shared_prefix_len == 448


def test_unknown_workload_is_refused_before_the_model_loads():
    """A typo in --workload must not quietly run some default shape: both bench entry points
    name the known workloads and exit 2; "custom" stays the base of the custom-workload flags."""
    assert get_workload("custom").num_requests == 16
    assert get_workload("W1") == load_workloads()["W1"]
    for argv in (["bench", "/nonexistent", "--workload", "W9"],
                 ["bench", "/nonexistent", "--executors", "uniproc", "--workload", "W9"]):
        r = subprocess.run([sys.executable, "-m", "llmsvc", *argv], cwd=ROOT, capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 2, r.stderr
        assert "unknown workload 'W9'" in r.stderr and "W1" in r.stderr


@pytest.mark.parametrize("argv, message", [
    (["--num-requests", "0"], "error: argument --num-requests: must be >= 1, got 0"),
    (["--num-requests", "-3"], "error: argument --num-requests: must be >= 1, got -3"),
    (["--input-len", "0"], "error: argument --input-len: must be >= 1, got 0"),
    (["--output-len", "-1"], "error: argument --output-len: must be >= 1, got -1"),
    (["--rate", "-1"], "error: argument --rate: must be a finite number > 0, got -1"),
    (["--concurrency", "0"], "error: argument --concurrency: must be >= 1, got 0"),
    (["--shared-prefix-len", "-1"], "error: argument --shared-prefix-len: must be >= 0, got -1"),
    (["--json-schema", "/nonexistent/schema.json"],
     "error: argument --json-schema: cannot read /nonexistent/schema.json: No such file or directory"),
    (["--sweep-rate", "a,b"], "error: argument --sweep-rate: invalid number: 'a'"),
    (["--sweep-rate", "1,0"], "error: argument --sweep-rate: must be a finite number > 0, got 0"),
    (["--sweep-concurrency", "2,x"], "error: argument --sweep-concurrency: invalid integer: 'x'"),
])
def test_bad_workload_flags_are_refused_before_the_model_loads(capsys, argv, message):
    from llmsvc.__main__ import main as llmsvc_main

    with pytest.raises(SystemExit) as exc:
        llmsvc_main(["bench", "/nonexistent", *argv])
    assert exc.value.code == 2 and capsys.readouterr().err.splitlines()[-1] == f"llmsvc bench: {message}"


def test_a_shared_prefix_longer_than_the_prompts_is_refused(capsys):
    from llmsvc.__main__ import main as llmsvc_main

    assert llmsvc_main(["bench", "/nonexistent", "--workload", "P1", "--input-len", "100"]) == 2
    assert capsys.readouterr().err == ("llmsvc bench: P1: the shared prefix (448 tokens) is longer than the "
                                       "prompts (100 tokens)\n")


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


def test_workloads_are_read_only_from_the_package(tmp_path, monkeypatch):
    # A decoy where an environment variable, the working directory or a folder beside the
    # checkout could have pointed: none of them may change what a standard workload means.
    decoy = tmp_path / "shared" / "bench" / "workloads.json"
    decoy.parent.mkdir(parents=True)
    decoy.write_text(json.dumps({"workloads": [{"name": "W1", "num_requests": 1, "input_len": 2,
                                                "output_len": 3}]}))
    monkeypatch.setenv("LLMSVC_WORKLOADS", str(decoy))
    monkeypatch.chdir(tmp_path)
    shipped = json.loads((ROOT / "llmsvc" / "bench" / "workloads.json").read_text())["workloads"]
    assert {n: (w.num_requests, w.input_len, w.output_len) for n, w in load_workloads().items()} == {
        w["name"]: (w["num_requests"], w["input_len"], w["output_len"]) for w in shipped}
    for module in (bench_cli, bench_executors):
        p = argparse.ArgumentParser()
        module.add_arguments(p)
        with pytest.raises(SystemExit):  # no flag names a workloads file either
            p.parse_args(["--workloads-file", str(decoy)])
    p = argparse.ArgumentParser()
    bench_cli.add_arguments(p)
    (w1,) = bench_cli._workloads(p.parse_args(["--workload", "W1"]))
    assert (w1.num_requests, w1.input_len, w1.output_len) == (64, 128, 128)


def test_prompts_are_deterministic_exact_length_and_ordinary_tokens():
    vocab = list(range(5, 1000))
    w = load_workloads()["P1"]
    a, b = build_prompts(w, vocab), build_prompts(w, vocab)
    assert a == b and len(a) == w.num_requests
    assert all(len(p) == w.input_len and set(p) <= set(vocab) for p in a)
    assert all(p[:448] == a[0][:448] for p in a)  # the shared prefix
    assert len({tuple(p[448:]) for p in a}) == w.num_requests  # own suffixes differ
    w2 = Workload("x", 3, 16, 4, seed=7)
    assert build_prompts(w2, vocab)[1] != build_prompts(w2, vocab)[2]


def test_several_prefixes_take_turns_and_the_first_is_the_single_prefix():
    vocab = list(range(5, 1000))
    p1 = load_workloads()["P1"]
    one = build_prompts(p1, vocab)
    four = build_prompts(dataclasses.replace(p1, num_prefixes=4), vocab)
    assert [p[448:] for p in four] == [p[448:] for p in one]  # own suffixes unchanged
    assert all(four[i][:448] == four[i % 4][:448] for i in range(len(four)))
    assert len({tuple(p[:448]) for p in four}) == 4
    assert four[0][:448] == one[0][:448]  # prefix 0 is P1's own
    p = argparse.ArgumentParser()
    bench_cli.add_arguments(p)
    (w,) = bench_cli._workloads(p.parse_args(["--workload", "P1", "--num-prefixes", "4"]))
    assert (w.name, w.num_prefixes, w.shared_prefix_len) == ("P1", 4, 448)


def test_ordinary_vocab_excludes_special_tokens():
    from server_harness import tiny_tokenizer

    tok = tiny_tokenizer()
    vocab = ordinary_vocab(tok)
    assert vocab and not set(vocab) & set(tok.all_special_ids)


def test_poisson_arrivals_have_the_configured_rate():
    w = Workload("p", 2000, 8, 8, seed=1, arrival="poisson", rate=4.0)
    offs = arrival_offsets(w)
    assert offs == sorted(offs) and offs[0] == 0.0
    assert abs((len(offs) - 1) / offs[-1] - 4.0) < 0.4
    assert arrival_offsets(Workload("a", 3, 8, 8)) == [0.0, 0.0, 0.0]


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


def test_ceiling_from_parameter_counts(tmp_path):
    d = make_tiny_model_dir(tmp_path, arch="llama", tie=True)
    c = param_counts(str(d))
    assert c["tied"] and c["lm_head"] == c["embedding"]
    assert c["gen_flops_per_token"] == 2 * c["total"]  # tied: the embedding is the LM head
    assert c["prompt_flops_per_token"] == 2 * (c["total"] - c["embedding"])
    w = Workload("w", 2, 10, 5)
    r = ceiling(w, c, flops_per_s=1e9)
    total = 2 * 10 * c["prompt_flops_per_token"] + 2 * 5 * c["gen_flops_per_token"]
    assert r["min_seconds"] == pytest.approx(total / 1e9) and r["output_tok_s"] == pytest.approx(10 / r["min_seconds"])


def test_ceiling_rate_is_that_of_the_arithmetic_the_cpu_engine_runs():
    # bf16 on a CPU without bf16 arithmetic computes in fp32 (gemm.c widens it): the ceiling
    # is the fp32 rate there, not that of torch's bf16, which oneDNN emulates on AVX-512
    # without AVX512-BF16 and which is a slow fallback on AVX2
    from kernels.cpu_ops import build, isa, linear
    from llmsvc.bench.ceiling import arithmetic_dtype
    assert arithmetic_dtype("float32", "cpu") == "float32"
    bf16_arithmetic = isa.at_least("avx512_bf16")  # the CPU's, lowered to LLMSVC_CPU_ISA
    lib = build.load()
    if lib is not None and lib.llmsvc_gemm_f32_supported() == 1 and not bf16_arithmetic:
        assert linear.bf16_layout() == "panels" and arithmetic_dtype("bfloat16", "cpu") == "float32"
    if linear.bf16_layout() == "vnni":
        assert bf16_arithmetic and arithmetic_dtype("bfloat16", "cpu") == "bfloat16"


def test_memory_floor_counts_weights_per_decode_step_and_every_kv_read(tmp_path):
    d = make_tiny_model_dir(tmp_path, arch="llama", tie=True)
    cfg = json.loads((Path(d) / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kvb = kv_bytes_per_token(str(d), 2)
    assert kvb == 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * 2
    c = param_counts(str(d))
    # 2 requests of 10 prompt tokens, 4 output tokens: 3 decode steps reading 11, 12, 13 rows
    m = memory_floor(Workload("w", 2, 10, 4), c, kv_token_bytes=kvb, dtype_bytes=2, bytes_per_s=1e9)
    assert m["weight_read_gb"] == pytest.approx(3 * c["total"] * 2 / 1e9)  # tied: every parameter once a step
    assert m["kv_read_gb"] == pytest.approx(2 * (11 + 12 + 13) * kvb / 1e9)
    assert m["min_seconds"] == pytest.approx(m["weight_read_gb"] + m["kv_read_gb"])
    assert m["output_tok_s"] == pytest.approx(8 / m["min_seconds"])
    one = memory_floor(Workload("w", 1, 10, 1), c, kvb, 2, 1e9)  # prefill only: no decode reads
    assert one["min_seconds"] == 0 and one["output_tok_s"] == float("inf")
    assert read_bandwidth(n_bytes=1 << 24, repeats=1, device="cpu") > 0


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


def test_gemm_weight_stream_bench_runs_every_implementation(capsys):
    from benchmarks import gemm
    gemm.main(["--rows", "3", "--layers", "1", "--rounds", "1", "--dtype", "float32"])
    out = capsys.readouterr().out
    assert "1 layers + LM head" in out
    line = next(l for l in out.splitlines() if "M =    3" in l)
    for name in ("ours", "library", "F.linear"):
        assert f"{name} " in line and "GB/s" in line


def test_attention_ab_compares_two_builds_in_one_process(capsys):
    import shutil
    import struct
    import subprocess

    from benchmarks import attention_ab
    from kernels.cpu_ops import attention
    if not attention.available() or shutil.which("git") is None:
        pytest.skip("needs the native kernels and a git checkout")
    if subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True).returncode != 0:
        pytest.skip("not a git checkout")
    attention_ab.main(["--rounds", "1", "--threads", "1"])
    tiny = struct.unpack("f", struct.pack("I", 1))[0]  # the smallest fp32 subnormal
    assert tiny * 1.0 != 0.0, "a library linked with -ffast-math turned on flush-to-zero in this process"
    out = capsys.readouterr().out
    rows = [l for l in out.splitlines() if "bit for bit" in l]
    assert len(rows) == len(attention_ab.SHAPES)
    unchanged = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", attention_ab._SRC]).returncode == 0
    for row in rows:
        assert "HEAD: min" in row and "tree: min" in row
        if unchanged:  # one source built twice: the same output, bit for bit (else NO)
            assert row.endswith("bit for bit: yes"), row


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "bfloat16-widen"])
def test_gemm_ab_compares_two_builds_in_one_process(capsys, dtype):
    import shutil
    import subprocess

    from benchmarks import gemm_ab
    from kernels.cpu_ops import build
    lib = build.load()
    supported = {"float32": "llmsvc_gemm_f32_supported", "bfloat16": "llmsvc_gemm_bf16_dp_supported",
                 "bfloat16-widen": "llmsvc_gemm_bf16_widen_supported"}[dtype]
    if lib is None or getattr(lib, supported)() != 1 or shutil.which("git") is None:
        pytest.skip(f"needs the native {dtype} panel GEMM and git")
    if subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True).returncode != 0:
        pytest.skip("not a git checkout")
    gemm_ab.main(["--dtype", dtype, "--rows", "3,17", "--layers", "1", "--rounds", "1", "--threads", "2"])
    out = capsys.readouterr().out
    assert "1 layers + LM head" in out
    verdicts = [l for l in out.splitlines() if "bit for bit" in l]
    assert [v.split(":")[0].strip() for v in verdicts] == ["M = 3", "M = 17"]
    rows = [l for l in out.splitlines() if "HEAD: min" in l and "tree: min" in l]
    assert [r.split()[0] for r in rows] == ["qkv", "o", "gate_up", "down", "lm_head", "pass"] * 2
    src = gemm_ab.GEMMS[dtype][0]
    if subprocess.run(["git", "diff", "--quiet", "HEAD", "--", src]).returncode == 0:
        assert all(v.endswith("bit for bit yes") for v in verdicts), verdicts


def test_step_floor_reads_every_weight_and_the_steps_kv(tmp_path):
    d = make_tiny_model_dir(tmp_path, arch="llama", tie=True)
    c, kvb = param_counts(str(d)), kv_bytes_per_token(str(d), 2)
    f = step_floor(c, kvb, 2, context_rows=4 * 30, bytes_per_s=1e9)
    assert f["weight_mb"] == pytest.approx(c["total"] * 2 / 1e6)  # tied: every parameter once
    assert f["kv_mb"] == pytest.approx(120 * kvb / 1e6)
    assert f["min_seconds"] == pytest.approx((f["weight_mb"] + f["kv_mb"]) / 1e3)


def test_decode_step_and_step_profile_on_a_tiny_model(tmp_path, capsys, monkeypatch):
    from benchmarks import step_profile
    d = str(make_tiny_model_dir(tmp_path, arch="llama", tie=True, max_position_embeddings=512))
    r = decode_step(d, "float32", bytes_per_s=1e9, seqs=3, context=20, steps=2)
    assert r["seqs"] == 3 and r["step_ms"] > 0
    assert r["ratio"] == pytest.approx(r["step_ms"] / r["floor_ms"])
    step_profile.main(["--model", d, "--dtype", "float32", "--seqs", "3", "--context", "20",
                       "--prefill", "256", "--repeats", "2"])
    out = capsys.readouterr().out
    assert "decode, 3 sequences at 20-22 keys: 2 steps" in out and "prefill, 2 x 128 prompt tokens: 2 steps" in out
    for part in ("inputs", "model", "lm_head", "sampler", "other", "step cpu"):
        assert f"  {part} " in out
    if "native layers: True" in out:  # the one-call path splits its time per kernel
        assert "    attention cpu " in out and "    gate_up " in out
    step_profile.main(["--model", d, "--dtype", "float32", "--seqs", "1", "--context", "8", "--prefill", "256",
                       "--prompt-len", "256", "--repeats", "1"])  # S1's shape: one 256-token prompt
    assert "prefill, 1 x 256 prompt tokens: 1 steps" in capsys.readouterr().out
    monkeypatch.setenv("LLMSVC_NATIVE_LAYERS", "0")  # per-op layers: no per-kernel split to show
    step_profile.main(["--model", d, "--dtype", "float32", "--seqs", "2", "--context", "8", "--prefill", "0",
                       "--repeats", "1"])
    out = capsys.readouterr().out
    assert "native layers: False" in out and "  model " in out and "attention" not in out


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


def test_warm_start_times_a_server_to_serving_and_reads_its_phases(tmp_path):
    from benchmarks import warm_start
    from tests.server_harness import make_tiny_served_model_dir
    d = str(make_tiny_served_model_dir(tmp_path))
    total, phases = warm_start.start_once(str(ROOT), [d, "--kv-cache-memory", "16MiB"])
    order = ["listening", "model loaded", "KV cache", "core ready", "ready"]
    assert set(order) <= set(phases), phases  # the log lines it reads still say what it looks for
    assert [phases[k] for k in order] == sorted(phases[k] for k in order)
    assert phases["ready"] <= total


def test_warm_start_puts_the_checkout_before_the_callers_pythonpath(monkeypatch):
    from benchmarks import warm_start
    monkeypatch.setenv("PYTHONPATH", "/opt/site")
    assert warm_start.server_env("/co")["PYTHONPATH"] == os.pathsep.join(["/co", "/opt/site"])
    monkeypatch.delenv("PYTHONPATH")
    assert warm_start.server_env("/co")["PYTHONPATH"] == "/co"


def test_frontend_cpu_passes_what_follows_the_double_dash_to_serve():
    from benchmarks import frontend_cpu
    a = frontend_cpu.parse_args(["/m", "--dtype", "float32", "--", "--executor", "multiproc", "--async-scheduling"])
    assert (a.model, a.dtype, a.serve_args) == ("/m", "float32", ["--executor", "multiproc", "--async-scheduling"])
    a = frontend_cpu.parse_args(["--workload", "W2"])
    assert (a.model, a.workload, a.serve_args) == (None, "W2", [])


def test_pipe_roundtrip_sends_a_decode_step_and_gets_its_output_back():
    import pickle

    from benchmarks import pipe_roundtrip
    so, mo = pipe_roundtrip.step_messages(8)
    back = pickle.loads(pickle.dumps(so, protocol=pickle.HIGHEST_PROTOCOL))
    assert back.num_scheduled_tokens == so.num_scheduled_tokens and back.total_num_scheduled_tokens == 8
    assert mo.req_ids == so.scheduled_cached_reqs.req_ids
    times = pipe_roundtrip.round_trips(8, 20)
    assert len(times) == 18 and all(t > 0 for t in times)


def test_random_model_copy_keeps_config_and_tokenizer(tmp_path):
    """benchmarks.random_model: same config and tokenizer files, new weights, and the copy serves."""
    from safetensors.torch import load_file

    from benchmarks.random_model import write_random_model
    from llmsvc import LLM, SamplingParams
    from tests.server_harness import make_tiny_served_model_dir

    src = make_tiny_served_model_dir(tmp_path / "src")
    out = write_random_model(src, str(tmp_path / "copy"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert Path(out, name).read_bytes() == Path(src, name).read_bytes()
    a, b = json.loads(Path(src, "config.json").read_text()), json.loads(Path(out, "config.json").read_text())
    keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size")
    assert [a[k] for k in keys] == [b[k] for k in keys]
    w_src, w_out = (load_file(str(next(Path(d).glob("*.safetensors")))) for d in (src, out))
    name = "model.layers.0.self_attn.q_proj.weight"
    assert w_src[name].shape == w_out[name].shape and not w_src[name].equal(w_out[name])
    bare = tmp_path / "bare"  # a config and tokenizer without weights make the same copy
    bare.mkdir()
    for f in Path(src).iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, bare / f.name)
    again = load_file(str(next(Path(write_random_model(str(bare), str(tmp_path / "again"))).glob("*.safetensors"))))
    assert again[name].equal(w_out[name])  # seed 0 both times
    llm = LLM(model=out, block_size=4, num_kv_blocks_override=16)
    try:
        (res,) = llm.generate("hello", SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True), use_tqdm=False)
        assert len(res.outputs[0].token_ids) == 3
    finally:
        llm.shutdown()
