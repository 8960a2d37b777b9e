"""Serving LoRA adapters beside the base model: one slot per adapter, every step mixing any of them.

Every linear layer of the decoder gets two stacked buffers at start-up (zero where a slot's
adapter leaves the layer alone), so loading an adapter only copies into them:
  lora_a [slots, n_sub * max_rank, in_per_rank]   sub-projection i (q/k/v of qkv_proj, gate/up of
  lora_b [slots, out_per_rank, n_sub * max_rank]  gate_up_proj) owns rows / columns i * max_rank ...
so that the update of a fused projection is one pair of GEMMs whose block-diagonal B sends each
sub-projection's low-rank product to its own output rows. B is sharded like the layer's weight
(loaded through the layer's own weight_loader); a row-parallel layer's A is sharded along its
input, and its partial update is added before the all-reduce (the update is linear in x).

Per step the runner calls `set_mapping(token slots)`; the layers read the mapping's groups. A
layer skips the slots whose adapter leaves it alone.
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
        self.packed: list = [(None, None)] * lora_a.shape[0]
        self.loaded = [False] * lora_a.shape[0]  # slots whose adapter touches this layer

    def repack(self, slot: int) -> None:
        self.packed[slot] = (ops.pack_linear_weight(self.lora_a[slot]), ops.pack_linear_weight(self.lora_b[slot]))

    def add_(self, y: torch.Tensor, x: torch.Tensor) -> None:
        groups = [g for g in self.manager.groups if self.loaded[g[0]]]
        if groups:
            ops.lora_add_(y, x, self.lora_a, self.lora_b, groups, self.packed, self.manager.token_slots)


class LoRAManager:
    """Owns the adapter slots of one rank's model: every linear layer of the decoder gets zeroed
    buffers for `slots` adapters at start-up, so that adapters load and unload at any time
    without allocating. Also holds the current step's token -> slot map."""

    def __init__(self, model: nn.Module, slots: int, max_rank: int) -> None:
        self.model, self.slots, self.max_rank = model, slots, max_rank
        self.groups: list[tuple[int, torch.Tensor | None]] = []  # (slot, token rows or None = all)
        self._native_groups: tuple | None = None  # the groups as ops.NativeLoRA wants them
        self.token_slots: torch.Tensor | None = None  # [T] int32 on the device: the groups per token
        self._native_table: tuple | None = None  # (ptrs, widths) or (None, None); reset by load / clear
        self.layers: dict[str, LinearBase] = {}
        for name, m in model.named_modules():
            if isinstance(m, LinearBase) and ".layers." in f".{name}":
                w = m.weight
                width = len(model.shard_ids(name + ".weight")) * max_rank
                device = "cpu" if w.is_meta else w.device  # meta: the layer multiplies GGUF blocks
                m.lora = LoRALayer(self, torch.zeros(slots, width, w.shape[1], dtype=w.dtype, device=device),
                                   torch.zeros(slots, w.shape[0], width, dtype=w.dtype, device=device))
                self.layers[name] = m
        if hasattr(model, "model") and hasattr(model.model, "lora_manager"):
            model.model.lora_manager = self

    def load(self, slot: int, adapter: LoRAAdapter) -> None:
        """Put `adapter` into `slot` (replacing what was there). Raises ValueError, leaving the
        slot empty, when a module of the adapter is not one of the model's linear layers or its
        shapes do not fit."""
        wanted: dict[str, list] = {}  # our layer name -> [(shard id, A, B piece)]
        for module, (a, b) in adapter.modules.items():
            for target, shard_id, piece in checkpoint_targets(self.model, module + ".weight", b,
                                                              self.model.checkpoint_splits()):
                layer_name = target.removesuffix(".weight")
                if layer_name not in self.layers:
                    raise ValueError(f"LoRA adapter {adapter.path!r}: module {module!r} is not a linear layer "
                                     "of this model's decoder")
                wanted.setdefault(layer_name, []).append((shard_id, a, piece))
        self.clear(slot)
        self._native_table = None
        try:
            for layer_name, entries in wanted.items():
                self._install(self.layers[layer_name], layer_name, slot, entries)
        except ValueError:
            self.clear(slot)
            raise

    def clear(self, slot: int) -> None:
        self._native_table = None
        for layer in self.layers.values():
            layer.lora.lora_a[slot].zero_()
            layer.lora.lora_b[slot].zero_()
            layer.lora.loaded[slot] = False
            layer.lora.packed[slot] = (None, None)

    def _install(self, layer: LinearBase, name: str, slot: int, entries: list) -> None:
        sub_ids = self.model.shard_ids(name + ".weight")
        w, r_max = layer.weight, self.max_rank
        lora_a, lora_b = layer.lora.lora_a, layer.lora.lora_b
        row_parallel = isinstance(layer, RowParallelLinear)
        full_in = w.shape[1] * (layer.tp_size if row_parallel else 1)
        for shard_id, a, b in entries:
            i = sub_ids.index(shard_id)
            cols = slice(i * r_max, (i + 1) * r_max)
            r = a.shape[0]
            full_out = layer.checkpoint_rows(shard_id)
            if a.shape[1] != full_in or b.shape[0] != full_out:
                part = "" if shard_id is None else f" (part {shard_id!r})"
                raise ValueError(f"LoRA weights of {name}{part} (A {tuple(a.shape)}, B {tuple(b.shape)}) do not "
                                 f"fit the layer ({full_in} inputs, {full_out} outputs)")
            if row_parallel:  # A [r, in] sharded along in; B [out, r] whole
                n = w.shape[1]
                a = a.narrow(1, layer.tp_rank * n, n)
                lora_b[slot, :, cols][:, :r] = b.to(w.dtype)
            else:  # B's rows go where the layer's weight rows for this shard go
                padded = torch.zeros(b.shape[0], r_max, dtype=w.dtype)
                padded[:, :r] = b
                layer.weight_loader(lora_b[slot, :, cols], padded.to(lora_b.device), shard_id)
            lora_a[slot, cols][:r] = a.to(w.dtype)
        layer.lora.loaded[slot] = True
        layer.lora.repack(slot)

    def set_mapping(self, token_slots: np.ndarray | None, device: torch.device) -> None:
        """token_slots: [T] int, each token's adapter slot (-1: base model), or None: no adapter."""
        self.groups, self._native_groups, self.token_slots = [], None, None
        if token_slots is None:
            return
        self.token_slots = torch.from_numpy(token_slots.astype(np.int32)).to(device)
        slots = np.unique(token_slots)
        all_rows = []
        for slot in slots[slots >= 0].tolist():
            rows = np.flatnonzero(token_slots == slot)
            all_rows.append(rows)
            self.groups.append((slot, None if len(slots) == 1 else torch.from_numpy(rows).to(device)))
        if all_rows and device.type == "cpu":
            offsets = np.cumsum([0] + [len(r) for r in all_rows])
            self._native_groups = (torch.tensor([g[0] for g in self.groups], dtype=torch.int64),
                                   torch.from_numpy(offsets.astype(np.int64)),
                                   torch.from_numpy(np.concatenate(all_rows).astype(np.int64)))

    def native(self, layers) -> "ops.NativeLoRA | None":
        """This step's adapters for the native decoder call over `layers` (the decoder layers, in
        order), or None where that call cannot apply them (a loaded adapter's weights not packed
        as the native GEMMs' panels)."""
        if self._native_groups is None:
            return None
        if self._native_table is None:
            self._native_table = self._make_native_table(layers)
        ptrs, widths = self._native_table
        if ptrs is None:
            return None
        return ops.NativeLoRA(*self._native_groups, ptrs, widths)

    def _make_native_table(self, layers) -> tuple:
        ptrs = torch.zeros((len(layers), 4, self.slots, 2), dtype=torch.int64)
        widths = torch.zeros((len(layers), 4), dtype=torch.int64)
        for l, layer in enumerate(layers):
            projs = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
            for p, proj in enumerate(projs):
                widths[l, p] = proj.lora.lora_a.shape[1]
                for slot in range(self.slots):
                    if not proj.lora.loaded[slot]:
                        continue
                    pa, pb = proj.lora.packed[slot]
                    if pa is None or pb is None or pa.dim() != 3 or pb.dim() != 3:
                        return None, None
                    ptrs[l, p, slot, 0], ptrs[l, p, slot, 1] = pa.data_ptr(), pb.data_ptr()
        return ptrs, widths

    @property
    def active(self) -> bool:
        return bool(self.groups)


def create_lora_manager(model: nn.Module, lora_config) -> LoRAManager | None:
    """Slots for lora_config.max_loras adapters in `model` (this rank's shards), the start-up
    adapters loaded into the first ones; None when LoRA is off."""
    if lora_config is None:
        return None
    manager = LoRAManager(model, lora_config.max_loras, lora_config.max_lora_rank)
    for slot, (name, path) in enumerate(lora_config.modules.items()):
        adapter = load_adapter(name, path, lora_config.max_lora_rank)
        manager.load(slot, adapter)
        logger.info("LoRA adapter %s loaded from %s (rank %d, %d modules)", name, path, adapter.rank,
                    len(adapter.modules))
    return manager
