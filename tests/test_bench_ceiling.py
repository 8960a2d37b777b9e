"""The benchmark's ceilings: compute and memory floors from a model's parameter counts, the floor
of one step, and a decode step and the step profile against them on a tiny model."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmsvc.bench.ceiling import (ceiling, decode_step, kv_bytes_per_token, memory_floor, param_counts,
                                  read_bandwidth, step_floor)
from llmsvc.bench.workloads import Workload
from model_utils import make_tiny_model_dir


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
    stored = memory_floor(Workload("w", 2, 10, 4), c, kvb, 2, 1e9, weight_bytes=1000)  # e.g. GGUF blocks
    assert stored["weight_read_gb"] == pytest.approx(3 * 1000 / 1e9) and stored["kv_read_gb"] == m["kv_read_gb"]
    one = memory_floor(Workload("w", 1, 10, 1), c, kvb, 2, 1e9)  # prefill only: no decode reads
    assert one["min_seconds"] == 0 and one["output_tok_s"] == float("inf")
    assert read_bandwidth(n_bytes=1 << 24, repeats=1, device="cpu") > 0


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


def test_decode_step_of_a_gguf_takes_its_blocks(tmp_path, monkeypatch):
    """--ceiling's decode step builds the engine from the model as given: a .gguf multiplies its
    blocks under "gguf" (or "auto", the default) and the floor counts the blocks' bytes."""
    gguf = pytest.importorskip("gguf")
    from test_models_gguf import write_gguf

    monkeypatch.setenv("LLMSVC_CACHE", str(tmp_path / "cache"))
    src = make_tiny_model_dir(tmp_path, arch="llama", tie=False, max_position_embeddings=512)
    path = str(tmp_path / "tiny.gguf")
    Q = gguf.GGMLQuantizationType
    write_gguf(src, path, "llama", {"proj": Q.Q8_0})
    plain = decode_step(path, "float32", bytes_per_s=1e9, seqs=2, context=20, steps=2, quantization="none")
    blocks = decode_step(path, "float32", bytes_per_s=1e9, seqs=2, context=20, steps=2, quantization="gguf")
    assert blocks["floor_ms"] < plain["floor_ms"]  # one int8 + 1/4 of a scale and an offset per weight, not 4 bytes
    assert plain["weight_bytes"] is None and 0 < blocks["weight_bytes"]  # what --ceiling's workload floor counts
