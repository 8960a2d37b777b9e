"""The scripts under benchmarks/: GEMM and attention A/B builds, warm start, the front end's CPU,
the pipe round trip, and random-weight copies of a model."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


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
    attention_ab.main(["--rounds", "1", "--threads", "1", "--layers", "2"])
    tiny = struct.unpack("f", struct.pack("I", 1))[0]  # the smallest fp32 subnormal
    assert tiny * 1.0 != 0.0, "a library linked with -ffast-math turned on flush-to-zero in this process"
    out = capsys.readouterr().out
    rows = [l for l in out.splitlines() if "bit for bit" in l]
    assert len(rows) == len(attention_ab.SHAPES)
    unchanged = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", *attention_ab._SRC]).returncode == 0
    for row in rows:
        assert "HEAD: min" in row and "tree: min" in row
        if unchanged:  # one source built twice: the same output, bit for bit (else NO)
            assert row.endswith("bit for bit: yes"), row


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "bfloat16-widen", "int8"])
def test_gemm_ab_compares_two_builds_in_one_process(capsys, dtype):
    import shutil
    import subprocess

    from benchmarks import gemm_ab
    from kernels.cpu_ops import build, int8
    lib = build.load()
    supported = {"float32": "llmsvc_gemm_f32_supported", "bfloat16": "llmsvc_gemm_bf16_dp_supported",
                 "bfloat16-widen": "llmsvc_gemm_bf16_widen_supported", "int8": None}[dtype]
    native = int8.isa() != "ref" if dtype == "int8" else lib is not None and getattr(lib, supported)() == 1
    if not native or shutil.which("git") is None:
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
    if subprocess.run(["git", "diff", "--quiet", "HEAD", "--", *gemm_ab.GEMMS[dtype][0]]).returncode == 0:
        assert all(v.endswith("bit for bit yes") for v in verdicts), verdicts


def test_gemm_ab_reuse_packs_each_weight_once():
    """--reuse multiplies the first layer's weights in every layer: they must stay one packed
    copy each, or they would stream from DRAM as distinct layers do."""
    import torch

    from benchmarks import gemm_ab
    w1, w2 = torch.ones(2, 2), torch.zeros(2, 2)
    calls = [("qkv", w1), ("o", w2)] * 3 + [("lm_head", torch.ones(3, 2))]
    packed_args = []

    def pack(w, *layout):
        packed_args.append((w, layout))
        return w.clone()

    out = gemm_ab._pack_each_once(calls, pack, (16,))
    assert len(packed_args) == 3 and all(layout == (16,) for _, layout in packed_args)
    assert out[0] is out[2] is out[4] and out[1] is out[3] is out[5] and out[0] is not out[1]
    assert [torch.equal(p, w) for p, (_, w) in zip(out, calls)] == [True] * 7


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
