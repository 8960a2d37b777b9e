"""Serving LoRA adapters beside the base model: one slot per adapter, every step mixing any of them.

Every linear layer an adapter touches gets two stacked buffers (zero where a slot leaves it alone):
  lora_a [slots, n_sub * max_rank, in_per_rank]   sub-projection i (q/k/v of qkv_proj, gate/up of
  lora_b [slots, out_per_rank, n_sub * max_rank]  gate_up_proj) owns rows / columns i * max_rank ...
so that the update of a fused projection is one pair of GEMMs whose block-diagonal B sends each
sub-projection's low-rank product to its own output rows. B is sharded like the layer's weight
(loaded through the layer's own weight_loader); a row-parallel layer's A is sharded along its
input, and its partial update is added before the all-reduce (the update is linear in x).

Per step the runner calls `set_mapping(token slots)`; the layers read the mapping's groups.
"""
from __future__ import annotations

import logging

import numpy as np
import torch
import torch.nn as nn

from kernels import ops
from llmsvc.models.layers.linear import LinearBase, RowParallelLinear
from llmsvc.models.lora_adapter import LoRAAdapter, load_adapter
from llmsvc.models.weights import checkpoint_targets

logger = logging.getLogger(__name__)


class LoRALayer:
    """One linear layer's stacked adapter weights; `add_(y, x)` applies this step's mapping."""

    def __init__(self, manager: "LoRAManager", lora_a: torch.Tensor, lora_b: torch.Tensor) -> None:
        self.manager, self.lora_a, self.lora_b = manager, lora_a, lora_b
        self.packed = [(ops.pack_linear_weight(lora_a[s]), ops.pack_linear_weight(lora_b[s]))
                       for s in range(lora_a.shape[0])]

    def add_(self, y: torch.Tensor, x: torch.Tensor) -> None:
        groups = self.manager.groups
        if groups:
            ops.lora_add_(y, x, self.lora_a, self.lora_b, groups, self.packed)


class LoRAManager:
    """Owns the adapters' buffers in one rank's model and the current step's token -> slot map."""

    def __init__(self, model: nn.Module, adapters: list[LoRAAdapter], max_rank: int) -> None:
        self.names = [a.name for a in adapters]
        self.groups: list[tuple[int, torch.Tensor | None]] = []  # (slot, token rows or None = all)
        layers = dict(model.named_modules())
        wanted: dict[str, list] = {}  # our layer name -> [(slot, sub, A, B piece, shard id)]
        for slot, adapter in enumerate(adapters):
            for module, (a, b) in adapter.modules.items():
                hits = list(checkpoint_targets(model, module + ".weight", b, model.checkpoint_splits()))
                for target, shard_id, piece in hits:
                    layer_name = target.removesuffix(".weight")
                    if not isinstance(layers.get(layer_name), LinearBase):
                        raise ValueError(f"LoRA adapter {adapter.path!r}: module {module!r} is not a "
                                         "linear layer of this model")
                    wanted.setdefault(layer_name, []).append((slot, shard_id, a, piece))
        for layer_name, entries in wanted.items():
            self._install(model, layers[layer_name], layer_name, entries, len(adapters), max_rank)
        self.num_layers = len(wanted)

    @staticmethod
    def _install(model, layer: LinearBase, name: str, entries: list, slots: int, max_rank: int) -> None:
        sub_ids = model.shard_ids(name + ".weight")
        w = layer.weight
        width = len(sub_ids) * max_rank
        lora_a = torch.zeros(slots, width, w.shape[1], dtype=w.dtype, device=w.device)
        lora_b = torch.zeros(slots, w.shape[0], width, dtype=w.dtype, device=w.device)
        row_parallel = isinstance(layer, RowParallelLinear)
        for slot, shard_id, a, b in entries:
            i = sub_ids.index(shard_id)
            cols = slice(i * max_rank, (i + 1) * max_rank)
            r = a.shape[0]
            if row_parallel:  # A [r, in] sharded along in; B [out, r] whole
                n = w.shape[1]
                a = a.narrow(1, layer.tp_rank * n, n)
                lora_b[slot, :, cols][:, :r] = b.to(w.dtype)
            else:  # B's rows go where the layer's weight rows for this shard go
                padded = torch.zeros(b.shape[0], max_rank, dtype=w.dtype)
                padded[:, :r] = b
                layer.weight_loader(lora_b[slot, :, cols], padded.to(w.device), shard_id)
            if a.shape[1] != w.shape[1]:
                raise ValueError(f"LoRA A of {name} has {a.shape[1]} inputs, the layer {w.shape[1]}")
            lora_a[slot, cols][:r] = a.to(w.dtype)
        layer.lora = LoRALayer(None, lora_a, lora_b)

    def attach(self, model: nn.Module) -> None:
        for m in model.modules():
            if isinstance(getattr(m, "lora", None), LoRALayer):
                m.lora.manager = self
            if hasattr(m, "lora_manager"):
                m.lora_manager = self

    def set_mapping(self, token_slots: np.ndarray | None, device: torch.device) -> None:
        """token_slots: [T] int, each token's adapter slot (-1: base model), or None: no adapter."""
        self.groups = []
        if token_slots is None:
            return
        slots = np.unique(token_slots)
        for slot in slots[slots >= 0].tolist():
            if len(slots) == 1:
                self.groups.append((slot, None))
            else:
                rows = np.flatnonzero(token_slots == slot)
                self.groups.append((slot, torch.from_numpy(rows).to(device)))

    @property
    def active(self) -> bool:
        return bool(self.groups)


def create_lora_manager(model: nn.Module, lora_config) -> LoRAManager | None:
    """Load every adapter of lora_config into `model` (this rank's shards); None without adapters."""
    if lora_config is None or not lora_config.modules:
        return None
    adapters = [load_adapter(n, p, lora_config.max_lora_rank) for n, p in lora_config.modules.items()]
    manager = LoRAManager(model, adapters, lora_config.max_lora_rank)
    manager.attach(model)
    for a in adapters:
        logger.info("LoRA adapter %s loaded from %s (rank %d, %d modules)", a.name, a.path, a.rank, len(a.modules))
    return manager
