"""The structured-output bitmask op: torch reference against a per-token loop, and the Triton
kernel against the reference (TRITON_INTERPRET=1 on the CPU, compiled on a GPU)."""
from __future__ import annotations

import contextlib

import pytest
import torch

from kernels import ops, reference as ref
from kernels.triton_ops import HAS_TRITON, INTERPRET

DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
NEG_INF = float("-inf")


def _case(S, V, R, W, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(S, V, generator=g)
    # random words over the whole int32 range, so the sign bit (token 31 of a word) is exercised
    bitmask = torch.randint(-(2 ** 31), 2 ** 31 - 1, (R, W), generator=g, dtype=torch.int64).to(torch.int32)
    rows = torch.randperm(S, generator=g)[:R].to(torch.int64)
    return logits, bitmask, rows


def _loop_reference(logits, bitmask, rows):
    out = logits.clone()
    W = bitmask.shape[1]
    for r, row in enumerate(rows.tolist()):
        for t in range(logits.shape[1]):
            word = int(bitmask[r, t // 32]) if t // 32 < W else 0
            if not (word >> (t % 32)) & 1:
                out[row, t] = NEG_INF
    return out


# (S, V, R, W): mask as wide as the logits; logits padded past the mask (model vocab > tokenizer
# vocab: those tokens are forbidden); mask wider than the logits (bits past V ignored); no rows
SHAPES = [(4, 96, 2, 3), (3, 100, 3, 3), (5, 70, 2, 3), (2, 64, 0, 2), (6, 1000, 4, 32)]


@pytest.mark.parametrize("shape", SHAPES)
def test_reference_matches_loop(shape):
    logits, bitmask, rows = _case(*shape, seed=sum(shape))
    out = logits.clone()
    ref.apply_token_bitmask_(out, bitmask, rows)
    torch.testing.assert_close(out, _loop_reference(logits, bitmask, rows))


def test_reference_leaves_other_rows_and_allowed_tokens_alone():
    logits, bitmask, rows = _case(6, 200, 3, 7, seed=3)
    out = logits.clone()
    ref.apply_token_bitmask_(out, bitmask, rows)
    others = [i for i in range(6) if i not in rows.tolist()]
    assert torch.equal(out[others], logits[others])
    kept = out[rows] != NEG_INF
    assert kept.any() and torch.equal(out[rows][kept], logits[rows][kept])


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_triton_matches_reference(shape, dtype):
    logits, bitmask, rows = _case(*shape, seed=7 + sum(shape))
    logits = logits.to(dtype)
    expected = logits.clone()
    ref.apply_token_bitmask_(expected, bitmask, rows)
    out = logits.to(DEVICE)
    guard = torch.full((out.shape[0], 8), float("nan"), dtype=dtype, device=DEVICE)
    buf = torch.cat([out, guard], dim=1)  # row stride V + 8: a wrong stride shows as a mismatch
    view = buf[:, :out.shape[1]]
    ctx = ops.force_triton() if DEVICE == "cpu" else contextlib.nullcontext()
    with ctx:
        ops.apply_token_bitmask_(view, bitmask.to(DEVICE), rows.to(DEVICE))
    assert torch.equal(view.cpu(), expected)
    assert torch.isnan(buf[:, out.shape[1]:]).all(), "the kernel wrote past a row"
