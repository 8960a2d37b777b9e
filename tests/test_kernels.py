"""Every Triton kernel against its torch reference, under TRITON_INTERPRET=1 (conftest).

On a machine with a CUDA GPU and TRITON_INTERPRET=0 the same tests launch the compiled
kernels on the GPU (inputs drawn on the CPU, placed on the GPU; the reference runs on the
CPU). Inputs live inside NaN-filled guard buffers (and caches keep NaN in every slot no
sequence owns), so a missing mask or a wrong stride shows up as NaN or a mismatch.
"""
from __future__ import annotations

import contextlib

import pytest
import torch

from kernels import ops, reference as ref
from kernels.triton_ops import HAS_TRITON, INTERPRET

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")

if HAS_TRITON:
    from kernels.triton_ops.paged_attention import paged_attention as triton_paged_attention

from kernel_utils import TOL, PagedBatch, guarded, guarded_rows  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"


def triton_path():
    """CPU tensors take the Triton path only when forced; CUDA tensors always do."""
    return ops.force_triton() if DEVICE == "cpu" else contextlib.nullcontext()


def _close(out, expected, dtype):
    out = out.cpu()
    assert not torch.isnan(out).any(), "NaN in kernel output: a load is missing its mask"
    torch.testing.assert_close(out.float(), expected.cpu().float(), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 64), (7, 576), (3, 100)])
def test_rms_norm(dtype, shape):
    g = torch.Generator().manual_seed(1)
    x = guarded_rows(torch.randn(*shape, generator=g).to(dtype), device=DEVICE)
    w = guarded(torch.rand(shape[1], generator=g).to(dtype) + 0.5, DEVICE)
    with triton_path():
        out = ops.rms_norm(x, w, 1e-6)
    _close(out, ref.rms_norm(x.cpu(), w.cpu(), 1e-6), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 64), (5, 576), (4, 96)])
def test_fused_add_rms_norm(dtype, shape):
    g = torch.Generator().manual_seed(2)
    x = guarded_rows(torch.randn(*shape, generator=g).to(dtype), device=DEVICE)
    r = guarded_rows(torch.randn(*shape, generator=g).to(dtype) * 4, device=DEVICE)
    w = guarded(torch.rand(shape[1], generator=g).to(dtype) + 0.5, DEVICE)
    x0, r0 = x.clone(), r.clone()
    with triton_path():
        normed, residual = ops.fused_add_rms_norm(x, r, w, 1e-5)
    exp_normed, exp_residual = ref.fused_add_rms_norm(x0.cpu(), r0.cpu(), w.cpu(), 1e-5)
    _close(residual, exp_residual, dtype)
    _close(normed, exp_normed, dtype)
    assert torch.equal(x, x0) and torch.equal(r, r0), "inputs must not be modified"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 128), (6, 3072), (3, 2 * 1536 + 2 * 37)])
def test_silu_and_mul(dtype, shape):
    g = torch.Generator().manual_seed(3)
    x = guarded_rows(torch.randn(*shape, generator=g).to(dtype) * 3, device=DEVICE)
    with triton_path():
        out = ops.silu_and_mul(x)
    assert out.shape == (shape[0], shape[1] // 2)
    _close(out, ref.silu_and_mul(x.cpu()), dtype)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # the interpreter's numpy
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_far_gates_stay_finite(dtype):
    """e^-g overflows for g below about -88.7 (fp32 math): silu must go to 0, not NaN."""
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(4))
    x[:, :8] = torch.tensor([-1e4, -1e3, -100.0, -89.0, 88.0, 100.0, 1e3, 1e4])
    x = guarded_rows(x.to(dtype), device=DEVICE)
    with triton_path():
        out = ops.silu_and_mul(x)
    _close(out, ref.silu_and_mul(x.cpu()), dtype)


def _cos_sin_cache(max_pos, rot, dtype=torch.float32, base=10000.0):
    inv = 1.0 / base ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot)
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,head_size,rot", [(4, 4, 64, 64), (9, 3, 64, 64), (8, 2, 32, 16),
                                                  (3, 1, 48, 48)])
def test_rotary_embedding(dtype, hq, hkv, head_size, rot):
    g = torch.Generator().manual_seed(4)
    t = 11
    # q and k are column slices of one fused qkv projection output inside a NaN guard
    qkv = guarded_rows(torch.randn(t, (hq + 2 * hkv) * head_size, generator=g).to(dtype),
                       device=DEVICE)
    q, k = qkv[:, :hq * head_size], qkv[:, hq * head_size:(hq + hkv) * head_size]
    positions = guarded(torch.randint(0, 200, (t,), generator=g), DEVICE)
    cache = guarded(_cos_sin_cache(256, rot), DEVICE)
    q_ref, k_ref = q.cpu().clone(), k.cpu().clone()
    ref.rotary_embedding(positions.cpu(), q_ref, k_ref, cache.cpu(), head_size)
    v_before = qkv[:, (hq + hkv) * head_size:].clone()
    with triton_path():
        assert ops.rotary_embedding(positions, q, k, cache, head_size) is None
    _close(q, q_ref, dtype)
    _close(k, k_ref, dtype)
    assert torch.equal(qkv[:, (hq + hkv) * head_size:], v_before), "rope wrote outside q and k"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hkv,d,block_size", [(1, 64, 16), (4, 32, 8), (3, 48, 16)])
def test_store_kv(dtype, hkv, d, block_size):
    g = torch.Generator().manual_seed(5)
    t, num_blocks = 13, 6
    nan_cache = torch.full((num_blocks, block_size, hkv, d), float("nan"), dtype=dtype)
    k_cache, v_cache = guarded(nan_cache, DEVICE), guarded(nan_cache, DEVICE)
    # key/value as views of a fused [T, 3 * Hkv, D] tensor (non-contiguous rows)
    kv = torch.randn(t, 3 * hkv, d, generator=g).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:t]
    slots[[2, 7]] = -1  # padding tokens: skipped
    slot_mapping = guarded(slots, DEVICE)
    k_ref, v_ref = nan_cache.clone(), nan_cache.clone()
    ref.store_kv(kv[:, :hkv], kv[:, hkv:2 * hkv], k_ref, v_ref, slots)
    kv = kv.to(DEVICE)
    with triton_path():
        ops.store_kv(kv[:, :hkv], kv[:, hkv:2 * hkv], k_cache, v_cache, slot_mapping)
    k_cache, v_cache = k_cache.cpu(), v_cache.cpu()
    torch.testing.assert_close(k_cache, k_ref, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, v_ref, atol=0, rtol=0, equal_nan=True)
    assert int((~torch.isnan(k_cache[..., 0, 0])).sum()) == t - 2


def _batch(*args, **kw) -> PagedBatch:
    return PagedBatch(*args, device=DEVICE, **kw)


def _check_attention(batch: PagedBatch, dtype, **kw):
    expected = ref.paged_attention(*batch.clean_args())
    if kw:
        out = triton_paged_attention(*batch.args(), **kw)
    else:
        with triton_path():
            out = ops.paged_attention(*batch.args())
    assert out.shape == batch.query.shape and out.dtype == batch.query.dtype
    _close(out, expected, dtype)


@pytest.mark.parametrize("hq,hkv", [(4, 4), (6, 2), (8, 2)])  # GQA ratios 1, 3, 4
def test_paged_decode(hq, hkv):
    seqs = [(1, 1), (15, 1), (16, 1), (17, 1), (100, 1)]
    _check_attention(_batch(seqs, hq, hkv, 32, seed=hq), torch.float32)


@pytest.mark.parametrize("hq,hkv", [(4, 4), (6, 2), (8, 2)])
def test_paged_decode_split_k(hq, hkv):
    # 32-key splits: contexts below, at and across split boundaries, reduced over up to 4 splits
    seqs = [(1, 1), (31, 1), (32, 1), (33, 1), (100, 1)]
    _check_attention(_batch(seqs, hq, hkv, 32, seed=10 + hq), torch.float32,
                     decode_split_size=32)


@pytest.mark.parametrize("hq,hkv", [(2, 2), (3, 1), (8, 2)])
def test_prefill(hq, hkv):
    seqs = [(15, 15), (16, 16), (17, 17), (1, 1)]
    _check_attention(_batch(seqs, hq, hkv, 32, seed=20 + hq), torch.float32)


@pytest.mark.parametrize("block_size", [16, 8])
def test_prefix_and_chunked_prefill(block_size):
    # a cached prefix + a new chunk: chunk rows see the whole prefix and causally the chunk
    seqs = [(100, 20), (40, 17), (17, 1), (33, 16)]
    _check_attention(_batch(seqs, 6, 2, 32, block_size=block_size, seed=30), torch.float32)


def test_mixed_batch_with_split_k_decodes():
    # decodes take the split-K kernel, chunks the varlen kernel, in the same call
    seqs = [(100, 1), (60, 12), (1, 1), (70, 70), (33, 1)]
    _check_attention(_batch(seqs, 8, 2, 32, seed=40), torch.float32, decode_split_size=32,
                     max_query_len=70, max_seq_len=100)


def test_non_power_of_two_head_dim():
    seqs = [(23, 23), (50, 1), (40, 9)]
    _check_attention(_batch(seqs, 3, 1, 48, seed=50), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_attention_half_dtypes(dtype):
    seqs = [(17, 17), (100, 1), (45, 13), (16, 1)]
    _check_attention(_batch(seqs, 6, 2, 64, dtype=dtype, seed=60), dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_split_k_half_dtypes(dtype):
    seqs = [(100, 1), (15, 1), (64, 1)]
    _check_attention(_batch(seqs, 4, 1, 64, dtype=dtype, seed=70), dtype, decode_split_size=32)


def test_cpu_process_never_imports_triton():
    """Triton loads on the first CUDA (or forced) op only: ~0.3 s of every CPU start-up."""
    import os
    import subprocess
    import sys

    code = ("import sys, torch; from kernels import ops; from kernels.triton_ops import HAS_TRITON; "
            "x = torch.randn(4, 64); ops.rms_norm(x, torch.ones(64), 1e-6); "
            "ops.silu_and_mul(torch.randn(4, 128)); print(HAS_TRITON, 'triton' in sys.modules)")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "LLMSVC_FORCE_TRITON")}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(HAS_TRITON), "False"]
