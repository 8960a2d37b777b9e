"""What a checkpoint directory declares: its JSON files, the dtype it runs in under --dtype auto,
and the sampling defaults of its generation_config.json. No torch or transformers import: the
front end resolves the same as the engine."""
from __future__ import annotations

import collections
import glob
import json
import os

from llmsvc.models.cache_files import cache_root
from llmsvc.sampling_params import GENERATION_DEFAULTS

# generation_config.json fields that become per-model sampling defaults (vLLM's
# generation_config="auto"), as SamplingParams declares them; max_new_tokens is renamed to
# SamplingParams.max_tokens
_GENERATION_DEFAULT_KEYS = tuple(GENERATION_DEFAULTS)


def read_json(path: str) -> dict:
    """The JSON object in path; {} when there is no such file."""
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


_SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


def checkpoint_dtype(model_dir: str) -> str:
    """The dtype a checkpoint declares: config.json's `dtype` (transformers v5) or
    `torch_dtype` (v4) when it names one of DTYPES, else the most common floating dtype of its
    safetensors weights (a GGUF checkpoint's derived directory holds its weights dequantized to
    fp32), else float32."""
    from llmsvc.config import DTYPES

    cfg = read_json(os.path.join(model_dir, "config.json"))
    for key in ("dtype", "torch_dtype"):
        name = str(cfg.get(key) or "").removeprefix("torch.")
        if name in DTYPES:
            return name
    counts: collections.Counter = collections.Counter()
    for path in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
        with open_safetensors(path, "numpy") as f:
            for name in f.keys():
                dt = _SAFETENSORS_DTYPES.get(f.get_slice(name).get_dtype())
                if dt:
                    counts[dt] += 1
    return counts.most_common(1)[0][0] if counts else "float32"


def open_safetensors(path: str, framework: str):
    """safe_open, with a torn or foreign file a ValueError naming it (the model is the caller's)."""
    from safetensors import safe_open

    try:
        return safe_open(path, framework=framework, device="cpu")
    except Exception as e:  # noqa: BLE001 - SafetensorError, OSError: one line at start-up
        root = os.path.realpath(cache_root())
        hint = ""
        if os.path.realpath(path).startswith(root + os.sep):  # a converted entry, torn: it can be remade
            hint = f"; it was converted into the model cache: delete {os.path.dirname(path)} to convert again"
        raise ValueError(f"cannot read the weights file {path}: {e}{hint}") from None


def check_dtype(requested: str) -> None:
    from llmsvc.config import DTYPE_CHOICES

    if requested not in DTYPE_CHOICES:
        raise ValueError(f"unsupported dtype {requested!r}; use one of {', '.join(DTYPE_CHOICES)}")


def resolve_dtype(requested: str, model_dir: str, device: str = "auto") -> str:
    """One of DTYPES for --dtype `requested` (one of DTYPE_CHOICES). "auto" is the checkpoint's
    dtype (checkpoint_dtype), except float16, which runs as bfloat16 unless the device is
    "cuda": the CPU kernels compute fp32 and bf16 only (as vLLM's CPU backend does with fp16
    checkpoints). Kept to the device as configured, not as detected, so that the front end
    (no torch) and the engine-core process resolve the same."""
    check_dtype(requested)
    if requested != "auto":
        return requested
    dtype = checkpoint_dtype(model_dir)
    return "bfloat16" if dtype == "float16" and device != "cuda" else dtype


def generation_defaults(model_gen: dict, source: str = "auto", override: dict | None = None) -> dict:
    """The sampling defaults of unset request fields: from the model's generation_config.json
    (`source` "auto"), none ("vllm"), or another generation_config (a directory or a JSON
    file), then `override`'s keys on top. max_new_tokens becomes max_tokens. ValueError for a
    missing source or an override key or value that is not a sampling default."""
    if source == "auto":
        gen = model_gen
    elif source == "vllm":
        gen = {}
    else:
        path = os.path.join(source, "generation_config.json") if os.path.isdir(source) else source
        if not os.path.isfile(path):
            raise ValueError(f"generation config {source!r}: no such file or directory with a "
                             "generation_config.json (use auto, vllm, or a path)")
        gen = read_json(path)
    keys = _GENERATION_DEFAULT_KEYS + ("max_new_tokens",)
    for k, v in (override or {}).items():
        if k not in keys:
            raise ValueError(f"override generation config: {k!r} is not one of {', '.join(keys)}")
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ValueError(f"override generation config: {k} must be a number, got {v!r}")
    if override:  # out-of-range values fail here, not in every request
        from llmsvc.sampling_params import SamplingParams
        try:
            SamplingParams(**{k: v for k, v in override.items() if k != "max_new_tokens"},
                           max_tokens=override.get("max_new_tokens", 16))
        except ValueError as e:
            raise ValueError(f"override generation config: {e}") from None
    gen = {**gen, **(override or {})}
    defaults = {k: gen[k] for k in _GENERATION_DEFAULT_KEYS if gen.get(k) is not None}
    if gen.get("max_new_tokens") is not None:
        defaults["max_tokens"] = gen["max_new_tokens"]
    return defaults
