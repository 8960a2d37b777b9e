"""The Triton LoRA update (shrink + expand, per token) against the torch reference, under
TRITON_INTERPRET=1 (conftest) or on a GPU: mixed adapter slots and base-model tokens (slot -1,
left untouched), ranks and widths that are no multiple of the blocks."""
from __future__ import annotations

import contextlib

import pytest
import torch

from kernels import ops, reference as ref
from kernels.triton_ops import HAS_TRITON, INTERPRET

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")

from kernel_utils import TOL, guarded_rows  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("k, r, n", [(64, 16, 96), (200, 48, 300)])
def test_lora_add_matches_the_reference(dtype, k, r, n):
    g = torch.Generator().manual_seed(k + r)
    slots = [2, -1, 0, 2, 0, -1, 2]
    t = len(slots)
    x = (torch.randn(t, k, generator=g)).to(dtype)
    y = torch.randn(t, n, generator=g).to(dtype)
    a = (torch.randn(3, r, k, generator=g) / k ** 0.5).to(dtype)
    b = (torch.randn(3, n, r, generator=g) / r ** 0.5).to(dtype)
    expect = y.float().clone()
    groups = [(s, torch.tensor([i for i, v in enumerate(slots) if v == s])) for s in (0, 2)]
    ref.lora_add_(expect, x.float(), a.float(), b.float(), groups)
    got = y.clone().to(DEVICE)
    token_slots = torch.tensor(slots, dtype=torch.int32, device=DEVICE)
    with ops.force_triton() if DEVICE == "cpu" else contextlib.nullcontext():
        ops.lora_add_(got, guarded_rows(x, device=DEVICE), a.to(DEVICE), b.to(DEVICE), groups, None, token_slots)
    got = got.cpu()
    assert not torch.isnan(got).any(), "NaN: a load is missing its mask"
    torch.testing.assert_close(got.float(), expect, **TOL[dtype])
    for i, s in enumerate(slots):
        if s < 0:
            assert torch.equal(got[i], y[i]), "a base-model token was changed"
