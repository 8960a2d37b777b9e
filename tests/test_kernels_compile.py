"""GPU builds of every kernel on the CPU, dispatch rules, custom ops under torch.compile."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from kernels import ops, reference as ref
from kernels.triton_ops import HAS_TRITON

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KERNELS = {"rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_embedding", "store_kv",
           "varlen_attention", "paged_decode_split", "paged_decode_reduce", "fused_moe_gate_up",
           "fused_moe_down", "lora_shrink", "lora_expand"}
SMEM_LIMIT = 228 * 1024  # H100 / A100 max dynamic shared memory per block is <= 228 KiB


def test_compile_for_gpu():
    """Full pipeline to cubin for sm_80 and sm_90 (a fresh process: the interpreter is off)."""
    configs = ["80:bf16", "90:fp16"]
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    r = subprocess.run([sys.executable, "-m", "kernels.triton_ops.aot", *configs], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    compiled = json.loads(r.stdout.strip().splitlines()[-1])
    for cfg in configs:
        arch, dtype = cfg.split(":")
        names = {k["name"] for k in compiled if k["arch"] == int(arch) and k["dtype"] == dtype}
        assert names == KERNELS, cfg
    for k in compiled:
        print(f"sm_{k['arch']} {k['dtype']:>4} {k['name']:<20} shared={k['shared_bytes']:>6} B "
              f"warps={k['num_warps']} cubin={k['cubin_bytes']} B")
        assert k["cubin_bytes"] > 0
        assert k["shared_bytes"] <= SMEM_LIMIT, f"{k['name']} needs {k['shared_bytes']} B of smem"


def test_cpu_path_calls_the_reference_directly(monkeypatch):
    # the custom-op layer must not sit on the CPU path: make any Triton call fail
    class Boom:
        def __getattr__(self, name):
            raise AssertionError(f"Triton op {name} called for CPU tensors")

    monkeypatch.setattr(ops, "_tri", Boom())
    assert not ops.triton_forced()
    x, w = torch.randn(3, 16), torch.ones(16)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6))
    torch.testing.assert_close(ops.silu_and_mul(x), ref.silu_and_mul(x))


def test_force_triton_is_scoped_and_uses_custom_ops(monkeypatch):
    calls = []
    real = torch.ops.llmsvc.silu_and_mul.default

    class Spy:
        def silu_and_mul(self, x):
            calls.append(x.shape)
            return real(x)

    monkeypatch.setattr(ops, "_tri", Spy())
    x = torch.randn(2, 32)
    with ops.force_triton():
        assert ops.triton_forced()
        out = ops.silu_and_mul(x)
    assert not ops.triton_forced()
    ops.silu_and_mul(x)
    assert calls == [torch.Size([2, 32])]
    torch.testing.assert_close(out, ref.silu_and_mul(x))


def test_custom_ops_registered_with_fake_impls():
    x, w = torch.randn(4, 32), torch.rand(32)
    for name in ("rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_embedding",
                 "store_kv", "paged_attention"):
        assert hasattr(torch.ops.llmsvc, name), name
    torch.library.opcheck(torch.ops.llmsvc.rms_norm.default, (x, w, 1e-6),
                          test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(torch.ops.llmsvc.fused_add_rms_norm.default, (x, x.clone(), w, 1e-6),
                          test_utils=("test_schema", "test_faketensor"))


def test_ops_under_torch_compile():
    """A decoder-layer-shaped function with every op forced to Triton, compiled in one graph."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    t, hq, hkv, d, bs = 5, 4, 2, 16, 8
    hidden = hq * d
    x, res = torch.randn(t, hidden, generator=g), torch.randn(t, hidden, generator=g)
    w = torch.rand(hidden, generator=g) + 0.5
    qkv_w = torch.randn(hidden, (hq + 2 * hkv) * d, generator=g) * 0.1
    mlp_w = torch.randn(hidden, 2 * 32, generator=g) * 0.1
    inv = 1.0 / 10000 ** (torch.arange(0, d, 2).float() / d)
    freqs = torch.outer(torch.arange(64).float(), inv)
    cos_sin = torch.cat((freqs.cos(), freqs.sin()), -1)
    positions = torch.tensor([3, 4, 5, 6, 7])
    slot_mapping = torch.tensor([11, 12, 13, 14, 15])
    block_tables = torch.tensor([[0, 1]], dtype=torch.int32)
    qsl = torch.tensor([0, 5], dtype=torch.int32)
    seq_lens = torch.tensor([8], dtype=torch.int32)

    def layer(x, res, k_cache, v_cache):
        h, res = ops.fused_add_rms_norm(x, res, w, 1e-6)
        qkv = h @ qkv_w
        q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
        q, k = q.contiguous(), k.contiguous()
        ops.rotary_embedding(positions, q, k, cos_sin, d)
        ops.store_kv(k.view(t, hkv, d), v.view(t, hkv, d), k_cache, v_cache, slot_mapping)
        o = ops.paged_attention(q.view(t, hq, d), k_cache, v_cache, block_tables, qsl, seq_lens,
                                d ** -0.5, max_query_len=5, max_seq_len=8)
        return ops.silu_and_mul(ops.rms_norm(o.view(t, hidden), w, 1e-6) @ mlp_w), res

    def caches():
        kc = torch.zeros(2, bs, hkv, d)
        kc.view(-1, hkv, d)[:11] = torch.randn(11, hkv, d, generator=torch.Generator().manual_seed(1))
        return kc, kc.clone()

    kc_ref, vc_ref = caches()
    expected = layer(x, res, kc_ref, vc_ref)  # eager, torch reference
    kc, vc = caches()
    with ops.force_triton():
        compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
        got = compiled(x, res, kc, vc)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kc, kc_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(vc, vc_ref, atol=1e-5, rtol=1e-5)


def test_import_without_triton_falls_back_to_reference():
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "from kernels import ops\n"
        "from kernels.triton_ops import HAS_TRITON\n"
        "assert not HAS_TRITON and ops._tri is None\n"
        "x = torch.randn(2, 8)\n"
        "assert ops.silu_and_mul(x).shape == (2, 4)\n"
        "try:\n"
        "    ops.force_triton().__enter__()\n"
        "except RuntimeError:\n"
        "    print('ok')\n")
    env = {k: v for k, v in os.environ.items() if k != "LLMSVC_FORCE_TRITON"}
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_env_var_forces_triton():
    code = ("from kernels import ops\n"
            "assert ops.triton_forced()\n"
            "print('forced')\n")
    env = {**os.environ, "LLMSVC_FORCE_TRITON": "1", "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "forced", r.stderr
