"""Loading an HF safetensors checkpoint into a model whose projections may be fused.

A model class declares how checkpoint tensors reach its parameters:
  checkpoint_target(name) (our parameter name, shard id) of one checkpoint tensor: q_proj ->
                          qkv_proj "q", an MoE expert's w1 -> (stacked gate_up_proj, (e, 0)), ...
  shard_ids(param name)   the shard ids a parameter's tensors arrive under ((None,): one tensor)
  checkpoint_splits(cfg)  {hf module: [(shard id, rows)]}: a checkpoint tensor that is already
                          fused (Phi-3's qkv_proj, gate_up_proj) is cut along dim 0 into shards,
                          so every fused parameter's weight_loader sees the same pieces whatever
                          the checkpoint's layout (and a TP rank keeps only its own part).
Sharded checkpoints (model-0000N-of-0000M.safetensors + model.safetensors.index.json) load
from the files the index names.
"""
from __future__ import annotations

import glob
import json
import os

import torch
import torch.nn as nn

from llmsvc.models.checkpoint import open_safetensors

SKIPPED_TENSORS = ("rotary_emb.inv_freq",)  # buffers some checkpoints carry


def checkpoint_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(model_dir, n) for n in names]
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    return files


def checkpoint_targets(model: nn.Module, name: str, tensor: torch.Tensor, splits: dict):
    """(our parameter name, shard id, tensor) for one checkpoint tensor."""
    for hf_name, pieces in splits.items():
        if f".{hf_name}." in name:
            start = 0
            for shard_id, rows in pieces:
                yield name, shard_id, tensor.narrow(0, start, rows)
                start += rows
            if start != tensor.shape[0]:
                raise ValueError(f"{name}: {tensor.shape[0]} rows, expected {start}")
            return
    target, shard_id = model.checkpoint_target(name)
    yield target, shard_id, tensor


def load_checkpoint(model: nn.Module, model_dir: str, splits: dict, tie_word_embeddings: bool) -> None:
    """Load every checkpoint tensor, one at a time, through its parameter's weight_loader
    (which keeps only this rank's shard). Raises KeyError for a tensor with no parameter and
    ValueError when a parameter (or a shard of a fused one) is left unloaded."""
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    for path in checkpoint_files(model_dir):
        with open_safetensors(path, "pt") as f:
            for name in f.keys():
                if name.endswith(SKIPPED_TENSORS):
                    continue
                if tie_word_embeddings and name == "lm_head.weight":
                    continue  # shares model.embed_tokens.weight
                for target, shard_id, tensor in checkpoint_targets(model, name, f.get_tensor(name), splits):
                    if target not in params:
                        raise KeyError(f"checkpoint tensor {name!r} has no parameter in {type(model).__name__}")
                    param = params[target]
                    loader = getattr(param, "weight_loader", None)
                    if loader is None:
                        param.data.copy_(tensor)
                    elif shard_id is None:
                        loader(param, tensor)
                    else:
                        loader(param, tensor, shard_id)
                    # a whole (already fused or stacked) tensor fills every shard of its parameter
                    shards = model.shard_ids(target) if shard_id is None else (shard_id,)
                    loaded |= {f"{target}:{s}" for s in shards}
    expected = {f"{name}:{s}" for name, _ in model.named_parameters() for s in model.shard_ids(name)}
    missing = sorted(expected - loaded)
    if missing:
        raise ValueError(f"weights missing from {model_dir}: {missing[:8]}")
