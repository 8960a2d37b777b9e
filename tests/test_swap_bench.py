"""The swap benchmarks on a tiny model: `llmsvc bench --compare-preemption` reruns the workload
preempting by recompute and prints swap's speedup; `python -m llmsvc.bench.swap multiturn`
computes fewer prompt tokens with the host tier, with equal greedy tokens."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.server_harness import make_tiny_served_model_dir

ROOT = Path(__file__).resolve().parents[1]


def _kv_bytes(model_dir, blocks: int, block_size: int = 16) -> str:
    """--kv-cache-memory of `blocks` blocks of the tiny model in float32."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * 4
    return str(blocks * block_size * per_token)


def test_bench_compare_preemption_offline(tmp_path):
    d = make_tiny_served_model_dir(tmp_path / "m")
    out = tmp_path / "r.json"
    r = subprocess.run([sys.executable, "-m", "llmsvc", "bench", str(d), "--num-requests", "6", "--input-len", "60",
                        "--output-len", "40", "--mode", "offline", "--kv-cache-memory", _kv_bytes(d, 14),
                        "--swap-space", "4MiB", "--compare-preemption", "--json", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())["workloads"]["custom"]
    assert res["offline"]["output_tok_s"] > 0 and res["offline_recompute_preemption"]["output_tok_s"] > 0
    assert res["swap_output_speedup"] > 0
    assert "llmsvc offline, recompute preemption" in r.stdout and "swap / recompute preemption" in r.stdout


def test_multiturn_host_tier_bench(tmp_path):
    from llmsvc.bench.swap import main

    d = make_tiny_served_model_dir(tmp_path / "m")
    out = tmp_path / "mt.json"
    assert main(["multiturn", "--model", str(d), "--dtype", "float32", "--kv-cache-memory", _kv_bytes(d, 12),
                 "--swap-space", "4MiB", "--conversations", "4", "--turns", "3", "--prefix-len", "64",
                 "--turn-len", "8", "--output-len", "4", "--json", str(out)]) == 0  # 0: greedy tokens equal
    res = json.loads(out.read_text())
    off, on = res["no host tier"], res["host tier"]
    assert on["host_tier_hits"] > 0 and on["prompt_tokens_computed"] < off["prompt_tokens_computed"]


def test_preemption_bench_without_prefix_caching_recomputes_what_swap_copies(tmp_path):
    """--no-prefix-caching: a recomputed request finds none of its blocks again, so recompute
    computes more prompt tokens than with the prefix cache, while swap's resumed requests compute
    only their last token either way."""
    from llmsvc.bench.swap import main

    d = make_tiny_served_model_dir(tmp_path / "m")
    args = ["preemption", "--model", str(d), "--dtype", "float32", "--kv-cache-memory", _kv_bytes(d, 14),
            "--swap-space", "4MiB", "--num-requests", "6", "--input-len", "60", "--output-len", "40"]
    res = {}
    for label, extra in (("cached", []), ("uncached", ["--no-prefix-caching"])):
        out = tmp_path / f"{label}.json"
        assert main(args + extra + ["--json", str(out)]) == 0  # 0: greedy tokens equal
        res[label] = json.loads(out.read_text())
    for r in res.values():
        assert r["recompute"]["preemptions"] > 0 and r["swap"]["swap_outs"] > 0
        assert r["swap"]["prompt_tokens_computed"] == 6 * 60  # each prompt once
    assert res["uncached"]["recompute"]["prompt_tokens_computed"] > res["cached"]["recompute"]["prompt_tokens_computed"]
