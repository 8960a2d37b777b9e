"""The mixture-of-experts ops: routing, the grouped-by-expert torch reference against a per-token
loop, and the Triton grouped GEMM against the reference (TRITON_INTERPRET=1 from conftest; on a
GPU with TRITON_INTERPRET=0 the kernel runs there). Inputs sit in NaN-filled guard buffers, so a
missing mask or a padding row that is read shows up as NaN."""
from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from kernel_utils import TOL, guarded, guarded_rows
from kernels import ops, reference_moe as ref
from kernels.triton_ops import HAS_TRITON, INTERPRET

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"


def _experts(e, h, i, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(e, 2 * i, h, generator=g) / h ** 0.5).to(dtype)
    w2 = (torch.randn(e, h, i, generator=g) / i ** 0.5).to(dtype)
    return w13, w2


def _routing(t, e, k, seed, skew=False):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(t, e, generator=g)
    if skew:  # every token's first choice is expert 0; some experts get nothing
        logits[:, 0] += 10.0
        logits[:, e // 2:] -= 10.0
    return ops.moe_route(logits, k, renormalize=True)


def _per_token_loop(x, w13, w2, weights, ids):
    """The definition, one token and one chosen expert at a time, in fp32."""
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = (w13[e].float() @ x[t].float()).chunk(2)
            out[t] += weights[t, j] * (w2[e].float() @ (F.silu(gate) * up))
    return out


def test_route_softmax_topk_and_renormalise():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.5, -1.0, 0.25, 4.0]])
    probs = torch.softmax(logits, -1)
    w, ids = ops.moe_route(logits, 2, renormalize=False)
    assert ids.tolist() == [[1, 2], [3, 0]] and w.dtype == torch.float32
    torch.testing.assert_close(w, torch.stack([probs[0, [1, 2]], probs[1, [3, 0]]]))
    wn, ids_n = ops.moe_route(logits, 2, renormalize=True)
    assert torch.equal(ids_n, ids)
    torch.testing.assert_close(wn, w / w.sum(-1, keepdim=True))
    torch.testing.assert_close(wn.sum(-1), torch.ones(2))


@pytest.mark.parametrize("t,e,k,h,i,skew", [(1, 4, 2, 32, 16, False), (9, 8, 2, 48, 24, False),
                                            (13, 8, 3, 32, 40, True), (5, 16, 1, 16, 16, False)])
def test_reference_equals_per_token_loop(t, e, k, h, i, skew):
    g = torch.Generator().manual_seed(t)
    x = torch.randn(t, h, generator=g)
    w13, w2 = _experts(e, h, i, torch.float32, seed=e)
    weights, ids = _routing(t, e, k, seed=i, skew=skew)
    out = ref.fused_moe(x, w13, w2, weights, ids)
    torch.testing.assert_close(out, _per_token_loop(x, w13, w2, weights, ids), atol=1e-5, rtol=1e-5)
    assert out.abs().max() > 0.1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_packed_experts_match_reference(dtype):
    """Each expert's GEMMs on the CPU packed kernels (as FusedMoE runs them after loading)."""
    t, e, k, h, i = 11, 8, 2, 64, 32
    w13, w2 = _experts(e, h, i, dtype, seed=2)
    packed = ops.pack_moe_weights(w13, w2)
    if packed is None:
        pytest.skip(f"no packed CPU GEMM for {dtype} here: the reference runs")
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(4)).to(dtype)
    weights, ids = _routing(t, e, k, seed=6, skew=True)
    out = ops.fused_moe(x, w13, w2, weights, ids, packed)
    torch.testing.assert_close(out.float(), ref.fused_moe(x, w13, w2, weights, ids).float(), **TOL[dtype])


def test_reference_no_tokens():
    w13, w2 = _experts(4, 16, 8, torch.float32, 0)
    out = ref.fused_moe(torch.zeros(0, 16), w13, w2, torch.zeros(0, 2), torch.zeros(0, 2, dtype=torch.int64))
    assert out.shape == (0, 16)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("block_m", [16, 64])
def test_align_pairs_tiles_hold_one_expert_each(block_m):
    from kernels.triton_ops.fused_moe import align_pairs
    e, k = 8, 2
    _, ids = _routing(37, e, k, seed=3, skew=True)
    pairs, tile_expert = align_pairs(ids, e, block_m)
    p = ids.numel()
    assert pairs.shape == (tile_expert.shape[0] * block_m,)
    assert tile_expert.shape[0] == min(p, -(-p // block_m) + e)  # bound known without a sync
    real = pairs[pairs < p]
    assert sorted(real.tolist()) == list(range(p))  # every pair once
    flat = ids.reshape(-1)
    for tile, expert in enumerate(tile_expert.tolist()):
        rows = pairs[tile * block_m:(tile + 1) * block_m]
        rows = rows[rows < p]
        if expert < 0:
            assert rows.numel() == 0
        else:
            assert rows.numel() > 0 and bool((flat[rows] == expert).all())
    used = tile_expert[tile_expert >= 0]
    assert bool((used[1:] >= used[:-1]).all())  # sorted by expert, unused tiles at the end
    assert bool((tile_expert[used.numel():] == -1).all())


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,e,k,h,i,skew", [(1, 4, 2, 64, 32, False), (6, 8, 2, 48, 40, True),
                                            (150, 8, 2, 32, 16, False)])  # 300 pairs: 64-row tiles
def test_triton_fused_moe_matches_reference(dtype, t, e, k, h, i, skew):
    g = torch.Generator().manual_seed(11)
    x = guarded_rows(torch.randn(t, h, generator=g).to(dtype), device=DEVICE)
    w13, w2 = _experts(e, h, i, dtype, seed=5)
    w13, w2 = guarded(w13, DEVICE), guarded(w2, DEVICE)
    weights, ids = _routing(t, e, k, seed=7, skew=skew)
    expected = ref.fused_moe(x.cpu(), w13.cpu(), w2.cpu(), weights, ids)
    with ops.force_triton() if DEVICE == "cpu" else contextlib.nullcontext():
        out = ops.fused_moe(x, w13, w2, weights.to(DEVICE), ids.to(DEVICE))
    assert out.shape == (t, h) and out.dtype == dtype
    out = out.cpu()
    assert not torch.isnan(out).any(), "NaN in kernel output: a load is missing its mask"
    torch.testing.assert_close(out.float(), expected.float(), **TOL[dtype])


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_custom_op_registered_with_fake_impl():
    w13, w2 = _experts(4, 16, 16, torch.float32, 0)
    weights, ids = _routing(3, 4, 2, seed=1)
    x = torch.randn(3, 16)
    assert hasattr(torch.ops.llmsvc, "fused_moe")
    torch.library.opcheck(torch.ops.llmsvc.fused_moe.default, (x, w13, w2, weights, ids),
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.skipif(not (HAS_TRITON and INTERPRET),
                    reason="CPU tensors take the Triton path only in the interpreter")
def test_moe_block_under_torch_compile_in_one_graph():
    """Router, routing and the Triton fused_moe custom op compile into one graph (no graph
    break, no host read), as CUDA-graph capture of a decode step needs."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(9)
    w13, w2 = _experts(8, 32, 16, torch.float32, seed=1)
    gate = torch.randn(8, 32, generator=g)
    x = torch.randn(5, 32, generator=g)

    def block(x):
        weights, ids = ops.moe_route(x @ gate.t(), 2, True)
        return ops.fused_moe(x, w13, w2, weights, ids)

    expected = block(x)  # eager, torch reference
    with ops.force_triton():
        got = torch.compile(block, backend="aot_eager", fullgraph=True)(x)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
