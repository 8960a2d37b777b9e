"""int64 offsets: a KV cache with more than 2^31 elements (slow on the CPU, needs ~9 GB of free
RAM; test_cuda.py runs the same check on a GPU)."""
from __future__ import annotations

import pytest
import torch

from kernels import ops, reference as ref
from kernels.triton_ops import HAS_TRITON, INTERPRET


def _available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


BS, HKV, D = 16, 1, 64


def _num_blocks() -> int:
    return (1 << 31) // (BS * HKV * D) + 64  # > 2^31 elements per cache


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.skipif(not INTERPRET, reason="CPU tensors take the Triton path only in the interpreter")
def test_cache_beyond_int32_offsets():
    need = 2 * _num_blocks() * BS * HKV * D * 2  # two fp16 caches
    if _available_bytes() < need + (2 << 30):
        pytest.skip(f"needs {need / 2**30:.1f} GiB free RAM")
    with ops.force_triton():
        check_cache_beyond_int32_offsets("cpu")


def check_cache_beyond_int32_offsets(device) -> None:
    """store_kv, varlen attention and split-K decode on blocks whose offsets pass 2^31
    elements, against the reference (also run by test_cuda.py on a GPU)."""
    num_blocks = _num_blocks()
    k_cache = torch.empty((num_blocks, BS, HKV, D), dtype=torch.float16, device=device)
    v_cache = torch.empty_like(k_cache)
    high = [num_blocks - 1, num_blocks - 5, num_blocks - 3]  # offsets past 2^31 elements
    g = torch.Generator().manual_seed(0)
    ctx = 40
    key = torch.randn(ctx, HKV, D, generator=g).half().to(device)
    value = torch.randn(ctx, HKV, D, generator=g).half().to(device)
    slots = torch.tensor([high[p // BS] * BS + p % BS for p in range(ctx)], dtype=torch.int64,
                         device=device)
    for b in high:
        k_cache[b].zero_()
        v_cache[b].zero_()
    ops.store_kv(key, value, k_cache, v_cache, slots)
    flat_k = k_cache.view(-1, HKV, D)
    assert torch.equal(flat_k[slots], key) and torch.equal(v_cache.view(-1, HKV, D)[slots], value)
    q = torch.randn(ctx, 4, D, generator=g).half().to(device)
    i32 = dict(dtype=torch.int32, device=device)
    bt = torch.tensor([high], **i32)
    args = (bt, torch.tensor([0, ctx], **i32), torch.tensor([ctx], **i32), D ** -0.5)
    expected = ref.paged_attention(q, k_cache, v_cache, *args)
    out = ops.paged_attention(q, k_cache, v_cache, *args)
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-3, rtol=2e-3)
    from kernels.triton_ops.paged_attention import paged_attention as tri
    dec_q = q[-1:].contiguous()
    dec_args = (bt, torch.tensor([0, 1], **i32), torch.tensor([ctx], **i32), D ** -0.5)
    out = tri(dec_q, k_cache, v_cache, *dec_args, decode_split_size=32)
    torch.testing.assert_close(out.float(), expected[-1:].float(), atol=2e-3, rtol=2e-3)
