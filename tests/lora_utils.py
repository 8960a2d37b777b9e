"""Random PEFT LoRA adapters for tiny test models, and the Hugging Face reference they imply
(the base model with each adapted weight replaced by W + scaling * B @ A)."""
from __future__ import annotations

import json
import math
import os
import re

import torch

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_lora_adapter(model_dir: str, out_dir: str, *, rank: int = 4, alpha: float = 8.0,
                      targets=ALL_TARGETS, seed: int = 0, use_rslora: bool = False,
                      alpha_pattern: dict | None = None, layers=None, **extra_config) -> str:
    """Write a PEFT adapter (adapter_config.json + adapter_model.safetensors) for the HF model in
    model_dir, with A and B both random (PEFT starts B at zero; a zero B would test nothing)."""
    from safetensors.torch import save_file
    from tests.model_utils import load_hf_model

    hf = load_hf_model(model_dir)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, module in hf.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf not in targets or not isinstance(module, torch.nn.Linear):
            continue
        if layers is not None and int(re.search(r"layers\.(\d+)\.", name).group(1)) not in layers:
            continue
        out_f, in_f = module.weight.shape
        tensors[f"base_model.model.{name}.lora_A.weight"] = torch.randn(rank, in_f, generator=g) / math.sqrt(in_f)
        tensors[f"base_model.model.{name}.lora_B.weight"] = torch.randn(out_f, rank, generator=g) / math.sqrt(rank)
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(targets),
              "use_rslora": use_rslora, "alpha_pattern": alpha_pattern or {}, "rank_pattern": {},
              "bias": "none", "modules_to_save": None, "use_dora": False, "fan_in_fan_out": False,
              "base_model_name_or_path": model_dir, "task_type": "CAUSAL_LM", **extra_config}
    with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    return out_dir


@torch.no_grad()
def merged_hf_model(model_dir: str, adapter_dir: str, dtype=torch.float32):
    """The HF model of model_dir with the adapter merged into its weights (PEFT's merge rule)."""
    from safetensors.torch import load_file
    from tests.model_utils import load_hf_model

    with open(os.path.join(adapter_dir, "adapter_config.json")) as f:
        cfg = json.load(f)
    tensors = load_file(os.path.join(adapter_dir, "adapter_model.safetensors"))
    hf = load_hf_model(model_dir, dtype=torch.float32)
    modules = dict(hf.named_modules())
    for key, a in tensors.items():
        if not key.endswith("lora_A.weight"):
            continue
        name = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
        b = tensors[key.replace("lora_A", "lora_B")]
        r = a.shape[0]
        alpha = next((float(v) for k, v in cfg["alpha_pattern"].items() if re.match(rf"(.*\.)?({k})$", name)),
                     float(cfg["lora_alpha"]))
        scaling = alpha / math.sqrt(r) if cfg["use_rslora"] else alpha / r
        modules[name].weight += scaling * (b @ a)
    return hf.to(dtype)
