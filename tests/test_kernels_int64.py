"""int64 offsets: a KV cache with more than 2^31 elements (slow, needs ~9 GB of free RAM)."""
from __future__ import annotations

import pytest
import torch

from kernels import ops, reference as ref
from kernels.triton_ops import HAS_TRITON


def _available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_cache_beyond_int32_offsets():
    bs, hkv, d = 16, 1, 64
    num_blocks = (1 << 31) // (bs * hkv * d) + 64  # > 2^31 elements per cache
    need = 2 * num_blocks * bs * hkv * d * 2  # two fp16 caches
    if _available_bytes() < need + (2 << 30):
        pytest.skip(f"needs {need / 2**30:.1f} GiB free RAM")
    k_cache = torch.empty((num_blocks, bs, hkv, d), dtype=torch.float16)
    v_cache = torch.empty_like(k_cache)
    high = [num_blocks - 1, num_blocks - 5, num_blocks - 3]  # offsets past 2^31 elements
    g = torch.Generator().manual_seed(0)
    ctx = 40
    key = torch.randn(ctx, hkv, d, generator=g).half()
    value = torch.randn(ctx, hkv, d, generator=g).half()
    slots = torch.tensor([high[p // bs] * bs + p % bs for p in range(ctx)], dtype=torch.int64)
    for b in high:
        k_cache[b].zero_()
        v_cache[b].zero_()
    with ops.force_triton():
        ops.store_kv(key, value, k_cache, v_cache, slots)
    flat_k = k_cache.view(-1, hkv, d)
    assert torch.equal(flat_k[slots], key) and torch.equal(v_cache.view(-1, hkv, d)[slots], value)
    q = torch.randn(ctx, 4, d, generator=g).half()
    bt = torch.tensor([high], dtype=torch.int32)
    args = (bt, torch.tensor([0, ctx], dtype=torch.int32), torch.tensor([ctx], dtype=torch.int32),
            d ** -0.5)
    expected = ref.paged_attention(q, k_cache, v_cache, *args)
    with ops.force_triton():
        out = ops.paged_attention(q, k_cache, v_cache, *args)
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-3, rtol=2e-3)
    from kernels.triton_ops.paged_attention import paged_attention as tri
    dec_q = q[-1:].contiguous()
    dec_args = (bt, torch.tensor([0, 1], dtype=torch.int32), torch.tensor([ctx], dtype=torch.int32),
                d ** -0.5)
    out = tri(dec_q, k_cache, v_cache, *dec_args, decode_split_size=32)
    torch.testing.assert_close(out.float(), expected[-1:].float(), atol=2e-3, rtol=2e-3)
