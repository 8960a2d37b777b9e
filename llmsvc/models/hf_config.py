"""A model's transformers config, resolved once and then kept as plain data.

Importing any transformers config class costs ~3 s in a fresh process: `configuration_utils`
pulls in `activations` -> `integrations.hub_kernels` -> `torch.distributed.tensor` and sympy.
The engine core, its workers and the front end each paid that before a model could load, for a
few dozen numbers. So the config is resolved through `AutoConfig` once per (config.json, model
directory, transformers version) and its full `to_dict()` stored as JSON under the llmsvc cache
(json_cache.py); later processes read that file and import neither transformers nor torch.

Every process sees the same object either way (HFConfig built from the JSON text), so a cold
start and a warm one cannot differ. Code that needs transformers' own class (rope types other
than "default" call transformers' rope functions) asks for `to_transformers()`.
"""
from __future__ import annotations

import json
import os

from llmsvc.models import json_cache


class HFConfig:
    """Read-only attribute view of a transformers config: every `to_dict()` value, plus the
    class's `attribute_map` aliases (Mixtral's `num_experts` -> `num_local_experts`). Missing
    names raise AttributeError, so `getattr(cfg, name, default)` behaves as on the real config
    for every attribute that config stores. Pickles as its two dicts."""

    __slots__ = ("_values", "_aliases")

    def __init__(self, values: dict, aliases: dict | None = None) -> None:
        object.__setattr__(self, "_values", dict(values))
        object.__setattr__(self, "_aliases", dict(aliases or {}))

    @classmethod
    def from_transformers(cls, config) -> "HFConfig":
        """Through transformers' own JSON serializer, as the cache stores it."""
        return cls(json.loads(config.to_json_string(use_diff=False)), type(config).attribute_map)

    def __getattr__(self, name: str):
        if name.startswith("__"):  # copy/pickle probing for hooks this class does not define
            raise AttributeError(name)
        values = object.__getattribute__(self, "_values")
        if name in values:
            return values[name]
        alias = object.__getattribute__(self, "_aliases").get(name)
        if alias is not None and alias in values:
            return values[alias]
        raise AttributeError(f"{values.get('model_type', 'model')} config has no attribute {name!r}")

    def __setattr__(self, name: str, value) -> None:
        raise AttributeError("HFConfig is read-only; resolve a new config instead")

    def __reduce__(self):
        return HFConfig, (self._values, self._aliases)

    def __eq__(self, other) -> bool:
        return isinstance(other, HFConfig) and (self._values, self._aliases) == (other._values, other._aliases)

    def __repr__(self) -> str:
        return f"HFConfig({self._values.get('model_type')!r}, {len(self._values)} fields)"

    def to_dict(self) -> dict:
        return json.loads(json.dumps(self._values))  # a deep copy the caller may change

    def to_transformers(self):
        """transformers' config object for these values (imports transformers)."""
        from transformers import CONFIG_MAPPING

        return CONFIG_MAPPING[self._values["model_type"]].from_dict(self.to_dict())


def load_hf_config(model_dir: str, cache_dir: str | None) -> HFConfig:
    """model_dir's config: read from cache_dir when this config.json in this directory was
    resolved before by this transformers version, else through `AutoConfig.from_pretrained`
    and then stored there (cache_dir None: no cache)."""
    path = None
    if cache_dir is not None:
        path = json_cache.entry_path(cache_dir, "config", [os.path.join(model_dir, "config.json")],
                                     os.path.realpath(model_dir))
        data = json_cache.read(path)
        if data is not None and isinstance(data.get("values"), dict) and isinstance(data.get("aliases"), dict):
            return HFConfig(data["values"], data["aliases"])
    from transformers import AutoConfig

    try:
        hf = AutoConfig.from_pretrained(model_dir)
    except ValueError as e:
        if "trust_remote_code" not in str(e):
            raise
        # transformers' advice (pass trust_remote_code=True) names no option of ours: llmsvc runs
        # no code from model directories, only the architectures it implements
        from llmsvc.models.loader_names import SUPPORTED_ARCHITECTURES
        raise ValueError(f"{model_dir}: config.json names a model type transformers does not know and "
                         "custom code for it (auto_map); llmsvc runs no code from model directories. "
                         f"Supported: {', '.join(SUPPORTED_ARCHITECTURES)}") from None
    config = HFConfig.from_transformers(hf)
    if path is not None:
        json_cache.write(path, {"values": config._values, "aliases": config._aliases})
    return config
