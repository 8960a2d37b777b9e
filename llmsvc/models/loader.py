"""Architecture registry and model construction for the worker."""
from __future__ import annotations

import torch
import torch.nn as nn

from llmsvc.config import ModelConfig
from llmsvc.models.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, kv_cache_spec
from llmsvc.models.loader_names import SUPPORTED_ARCHITECTURES

_MODELS: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
}
assert tuple(_MODELS) == SUPPORTED_ARCHITECTURES
_DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
           "float16": torch.float16, "half": torch.float16}

__all__ = ["get_model_class", "build_model", "kv_cache_spec", "to_torch_dtype", "supported_architectures"]


def supported_architectures() -> list[str]:
    return list(_MODELS)


def get_model_class(architecture: str) -> type[nn.Module]:
    try:
        return _MODELS[architecture]
    except KeyError:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: {', '.join(_MODELS)}") from None


def to_torch_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[str(dtype).removeprefix("torch.")]
    except KeyError:
        raise ValueError(f"unsupported dtype {dtype!r}; use float32, bfloat16 or float16") from None


@torch.no_grad()
def build_model(model_config: ModelConfig, device: str | torch.device = "cpu", dtype=None) -> nn.Module:
    """Build the model for `model_config` on `device` and load this TP rank's weights.

    model_config is resolved first if it is not yet (no hf_config). dtype defaults to
    model_config.dtype. The TP process group, if any, must be initialised before."""
    if model_config.hf_config is None or model_config.model_dir is None:
        from llmsvc.models.resolve import resolve_model_config
        model_config = resolve_model_config(model_config)
    torch_dtype = to_torch_dtype(dtype or model_config.dtype)
    cls = get_model_class(model_config.architecture)
    with torch.device(device):
        model = cls(model_config.hf_config, torch_dtype, model_config.max_model_len)
    model.load_weights(model_config.model_dir)
    return model.eval()
