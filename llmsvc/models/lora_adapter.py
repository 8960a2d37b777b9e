"""A PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors / .bin) read
into per-module (A, B) pairs with the adapter's scaling folded into B.

PEFT names tensors `base_model.model.<HF module>.lora_A.weight` ([r, in]) and `...lora_B.weight`
([out, r]); the update of a module is scaling * B @ A with scaling = alpha / r (alpha / sqrt(r)
with use_rslora), alpha taken from alpha_pattern where a key matches the module. What this engine
cannot apply fails here, by name: DoRA, LoRA biases, modules_to_save, embedding adapters, a rank
above max_lora_rank.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

import torch


@dataclass
class LoRAAdapter:
    name: str
    path: str
    rank: int  # the largest r of its modules
    # HF module name ("model.layers.0.self_attn.q_proj") -> (A [r, in], B [out, r] * scaling)
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]]


def _read_config(path: str) -> dict:
    cfg_path = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"LoRA adapter {path!r}: no adapter_config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)  # JSONDecodeError is a ValueError
    if not isinstance(cfg, dict):
        raise ValueError(f"LoRA adapter {path!r}: adapter_config.json holds {type(cfg).__name__}, not an object")
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise ValueError(f"LoRA adapter {path!r}: peft_type {cfg['peft_type']!r} is not LORA")
    unsupported = {"use_dora": bool(cfg.get("use_dora")), "bias": cfg.get("bias", "none") != "none",
                   "modules_to_save": bool(cfg.get("modules_to_save")),
                   "fan_in_fan_out": bool(cfg.get("fan_in_fan_out"))}
    bad = [k for k, v in unsupported.items() if v]
    if bad:
        raise ValueError(f"LoRA adapter {path!r}: {', '.join(bad)} not supported")
    for key in ("lora_alpha", "r"):
        if key in cfg and not _is_number(cfg[key]):
            raise ValueError(f"LoRA adapter {path!r}: {key} is {cfg[key]!r}, not a number")
    pattern = cfg.get("alpha_pattern") or {}
    if not isinstance(pattern, dict):
        raise ValueError(f"LoRA adapter {path!r}: alpha_pattern is not an object")
    for key, alpha in pattern.items():
        if not _is_number(alpha):
            raise ValueError(f"LoRA adapter {path!r}: alpha_pattern[{key!r}] is {alpha!r}, not a number")
        try:
            re.compile(key)
        except re.error as e:
            raise ValueError(f"LoRA adapter {path!r}: alpha_pattern key {key!r} is not a regex: {e}") from None
    return cfg


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _read_tensors(path: str) -> dict[str, torch.Tensor]:
    st = os.path.join(path, "adapter_model.safetensors")
    bin_path = os.path.join(path, "adapter_model.bin")
    try:  # the file is the caller's: whatever fails to parse is its error, by name
        if os.path.isfile(st):
            from safetensors.torch import load_file
            return load_file(st)
        if os.path.isfile(bin_path):
            tensors = torch.load(bin_path, map_location="cpu", weights_only=True)
            if not isinstance(tensors, dict) or not all(isinstance(t, torch.Tensor) for t in tensors.values()):
                raise ValueError("not a dict of tensors")
            return tensors
    except Exception as e:  # noqa: BLE001 - SafetensorError, UnpicklingError, ...
        raise ValueError(f"LoRA adapter {path!r}: weights cannot be read: {type(e).__name__}: {e}") from None
    raise FileNotFoundError(f"LoRA adapter {path!r}: no adapter_model.safetensors or adapter_model.bin")


def _alpha(cfg: dict, module: str) -> float:
    for pattern, alpha in (cfg.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            return float(alpha)
    return float(cfg.get("lora_alpha", cfg.get("r", 8)))


def load_adapter(name: str, path: str, max_rank: int) -> LoRAAdapter:
    """Read and check one adapter (tensors on the CPU, in their file's dtype)."""
    cfg = _read_config(path)
    tensors = _read_tensors(path)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = re.fullmatch(r"(?:base_model\.model\.)?(.+)\.(lora_A|lora_B)(?:\.[^.]+)?\.weight", key)
        if m is None:
            raise ValueError(f"LoRA adapter {path!r}: tensor {key!r} is not a lora_A / lora_B weight "
                             "(embedding adapters and extra trained modules are not supported)")
        pairs.setdefault(m.group(1), {})[m.group(2)] = t
    modules = {}
    for module, ab in pairs.items():
        if set(ab) != {"lora_A", "lora_B"}:
            raise ValueError(f"LoRA adapter {path!r}: {module} has {sorted(ab)} only")
        a, b = ab["lora_A"], ab["lora_B"]
        r = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != r or r == 0:
            raise ValueError(f"LoRA adapter {path!r}: {module} has A {tuple(a.shape)} and B {tuple(b.shape)}")
        if r > max_rank:
            raise ValueError(f"LoRA adapter {path!r}: {module} has rank {r}, above --max-lora-rank {max_rank}")
        alpha = _alpha(cfg, module)
        scaling = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
        modules[module] = (a.float(), b.float() * scaling)
    if not modules:
        raise ValueError(f"LoRA adapter {path!r} holds no LoRA weights")
    return LoRAAdapter(name, path, max(a.shape[0] for a, _ in modules.values()), modules)
