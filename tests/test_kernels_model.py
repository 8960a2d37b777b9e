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
        expected = _same_step(torch_runner, triton_runner, step)
        assert expected["a"].abs().max() > 0.1  # logits are not trivially zero


def _same_step(torch_runner, triton_runner, step: dict) -> dict:
    """Run `step` on both runners (the second with every op on the Triton path); their logits
    agree. Returns the torch path's."""
    expected = torch_runner.step(step)
    with ops.force_triton():
        got = triton_runner.step(step)
    for sid in step:
        assert not torch.isnan(got[sid]).any(), sid
        torch.testing.assert_close(got[sid], expected[sid], atol=1e-4, rtol=1e-4)
    return expected


def test_tiny_model_with_lora_adapters_triton_equals_torch(tmp_path):
    """The same steps with sequences on two LoRA adapters and one on the base model: the Triton
    update (per token) equals the torch reference (per group) inside the whole forward."""
    import numpy as np

    from llmsvc.config import LoRAConfig
    from llmsvc.models.lora import create_lora_manager
    from tests.lora_utils import make_lora_adapter
    from tests.model_utils import PagedRunner, load_our_model, make_tiny_model_dir

    model_dir = make_tiny_model_dir(tmp_path, "llama")
    model = load_our_model(model_dir)
    manager = create_lora_manager(model, LoRAConfig(
        {"x": make_lora_adapter(model_dir, str(tmp_path / "x"), seed=1),
         "y": make_lora_adapter(model_dir, str(tmp_path / "y"), rank=8, seed=2, targets=("v_proj", "up_proj"))},
        max_lora_rank=8))
    slot_of = {"a": 0, "b": -1, "c": 1}
    torch_runner = PagedRunner(model, num_blocks=16, block_size=16, seed=3)
    triton_runner = PagedRunner(model, num_blocks=16, block_size=16, seed=3)
    for step in _steps():
        manager.set_mapping(np.repeat([slot_of[s] for s in step], [len(t) for t in step.values()]),
                            torch.device("cpu"))
        model.model._native_plan, model.model._native_planned = None, True  # per-op: ops dispatch each call
        _same_step(torch_runner, triton_runner, step)
