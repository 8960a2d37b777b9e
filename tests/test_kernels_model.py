"""A whole forward of a tiny Llama with every op on the Triton path (interpreter) equals the
torch path's logits: prefill, chunked prefill with a cached prefix, and mixed decode steps."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from kernels import ops
from kernels.triton_ops import HAS_TRITON, INTERPRET

pytestmark = [
    pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed"),
    pytest.mark.skipif(not INTERPRET, reason="CPU tensors take the Triton path only in the "
                       "interpreter; test_cuda.py runs the model on a GPU against HF"),
    pytest.mark.skipif(importlib.util.find_spec("llmsvc.models.llama") is None,
                       reason="llmsvc.models.llama does not exist yet"),
]


def _steps():
    a, b, c = list(range(3, 40)), list(range(50, 57)), list(range(100, 120))
    return [
        {"a": a[:20], "b": b},  # prefills (b fully, a's first chunk)
        {"a": a[20:], "b": [9], "c": c},  # a's chunk over its cached prefix + a decode + a prompt
        {"a": [11], "b": [12], "c": [13]},  # decodes
    ]


def test_tiny_model_forward_triton_equals_torch(tmp_path):
    from tests.model_utils import PagedRunner, load_our_model, make_tiny_model_dir

    model_dir = make_tiny_model_dir(tmp_path, "llama")
    model = load_our_model(model_dir)
    torch_runner = PagedRunner(model, num_blocks=16, block_size=16, seed=3)
    triton_runner = PagedRunner(model, num_blocks=16, block_size=16, seed=3)
    for k_cache, v_cache in triton_runner.kv_caches:  # unwritten slots: NaN, must stay unread
        k_cache.fill_(float("nan"))
        v_cache.fill_(float("nan"))
    for step in _steps():
        expected = torch_runner.step(step)
        with ops.force_triton():
            got = triton_runner.step(step)
        for sid in step:
            assert not torch.isnan(got[sid]).any(), sid
            torch.testing.assert_close(got[sid], expected[sid], atol=1e-4, rtol=1e-4)
        assert expected["a"].abs().max() > 0.1  # logits are not trivially zero
