"""Model construction: the architecture registry's class, its dtype, its weights, its quantization.

`build_model` is the one entry point the workers (and tests) build a model through; the model
families live in llama.py, gemma3.py and moe.py.
"""
from __future__ import annotations

import importlib
import logging

import torch
import torch.nn as nn

from llmsvc.config import DTYPES, ModelConfig
from llmsvc.models.llama import head_dim_of, kv_cache_spec
from llmsvc.models.loader_names import ARCHITECTURES

__all__ = ["build_model", "get_model_class", "kv_cache_spec", "to_torch_dtype"]

logger = logging.getLogger(__name__)

_DTYPES = {name: getattr(torch, name) for name in DTYPES}


def get_model_class(architecture: str) -> type[nn.Module]:
    try:
        module, _, name = ARCHITECTURES[architecture].partition(":")
    except KeyError:
        raise ValueError(f"unsupported architecture {architecture!r}; "
                         f"supported: {', '.join(ARCHITECTURES)}") from None
    return getattr(importlib.import_module(module), name)


def to_torch_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[str(dtype).removeprefix("torch.")]
    except KeyError:
        raise ValueError(f"unsupported dtype {dtype!r}; use one of {', '.join(DTYPES)}") from None


@torch.no_grad()
def build_model(model_config: ModelConfig, device: str | torch.device = "cpu", dtype=None) -> nn.Module:
    """Build the model for `model_config` on `device` and load this TP rank's weights.

    model_config is resolved first if it is not yet (no hf_config). dtype (str or
    torch.dtype) defaults to model_config.dtype. A TP process group, if any, must be
    initialised before: the layers read rank and world size at construction."""
    if model_config.hf_config is None or model_config.model_dir is None:
        from llmsvc.models.resolve import resolve_model_config
        model_config = resolve_model_config(model_config)
    torch_dtype = to_torch_dtype(dtype or model_config.dtype)
    cls = get_model_class(model_config.architecture)
    with torch.device(device):
        model = cls(model_config.hf_config, torch_dtype, model_config.max_model_len)
    model.load_weights(model_config.model_dir)
    if model_config.quantization == "gguf" and torch.device(device).type != "cpu":
        # only a device "auto" that became a GPU gets here (check_quantization refuses "cuda"),
        # e.g. the default quantization "auto" with a .gguf model on a GPU machine
        logger.info("quantization 'gguf': GGUF blocks are a CPU path; the GPU multiplies the dequantized weights")
    elif model_config.quantization == "gguf":
        from llmsvc.models.gguf_blocks import load_gguf_blocks
        from llmsvc.models.resolve import gguf_file

        load_gguf_blocks(model, gguf_file(model_config.model), model_config.model_dir,
                         head_dim_of(model_config.hf_config))
    for module in model.modules():
        if hasattr(module, "process_weights_after_loading"):
            module.process_weights_after_loading()
    if model_config.quantization == "int8":
        from llmsvc.models.int8_weights import quantize_linear_layers

        quantize_linear_layers(model)
    return model.eval()
