"""The experts of a mixture-of-experts layer as two stacked weights, sharded over TP ranks.

  gate_up_proj: [E, 2 * I_r, H]  per expert [gate_r | up_r] (nn.Linear layout), I_r = I / tp
  down_proj:    [E, H, I_r]

(Hugging Face transformers names these two stacked parameters the same way.) Tensor
parallelism splits every expert's intermediate dim, as a column-parallel gate/up and a
row-parallel down projection per expert: each rank runs every routed token through its slice
of the chosen experts and the partial outputs are all-reduced. Every rank computes the same
routing from replicated router weights, so no token has to move between ranks, the work per
rank does not depend on how routing falls, and any expert count splits over any tp that
divides I.

Checkpoint tensors arrive per expert (shard id (expert, 0 | 1) for gate / up, expert for
down) or already stacked (shard id None).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from kernels import ops
from llmsvc.models.parallel import divide, get_tp_rank, get_tp_world_size, tensor_model_parallel_all_reduce


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"expert weight shape {tuple(src.shape)} does not fit {tuple(dst.shape)}")
    dst.copy_(src)


class FusedMoE(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 params_dtype: torch.dtype | None = None):
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_world_size()
        self.num_experts, self.hidden_size = num_experts, hidden_size
        self.intermediate_size = intermediate_size
        self.i_rank = divide(intermediate_size, self.tp_size)
        dtype = params_dtype or torch.get_default_dtype()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * self.i_rank, hidden_size, dtype=dtype),
                                         requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, self.i_rank, dtype=dtype),
                                      requires_grad=False)
        self.gate_up_proj.weight_loader = self.weight_loader
        self.down_proj.weight_loader = self.weight_loader
        self.packed: tuple[list, list] | None = None  # set by process_weights_after_loading

    def process_weights_after_loading(self) -> None:
        """Once the weights are final: pre-pack every expert's GEMMs for the CPU where that applies."""
        self.packed = ops.pack_moe_weights(self.gate_up_proj.data, self.down_proj.data)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        """loaded_weight is the FULL Hugging Face tensor: gate or up [I, H] of one expert, down
        [H, I] of one expert, or a stacked [E, 2I, H] / [E, H, I]; this rank's slice is kept."""
        ir, lo = self.i_rank, self.tp_rank * self.i_rank
        if param is self.down_proj:
            if shard_id is None:
                _copy(param.data, loaded_weight.narrow(2, lo, ir))
            else:
                _copy(param.data[shard_id], loaded_weight.narrow(1, lo, ir))
            return
        if shard_id is None:  # stacked [E, gate | up, H]
            for j in (0, 1):
                part = loaded_weight.narrow(1, j * self.intermediate_size, self.intermediate_size)
                _copy(param.data[:, j * ir:(j + 1) * ir], part.narrow(1, lo, ir))
            return
        expert, j = shard_id
        _copy(param.data[expert, j * ir:(j + 1) * ir], loaded_weight.narrow(0, lo, ir))

    def forward(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """hidden [T, H], routing [T, k] -> [T, H], summed over ranks."""
        out = ops.fused_moe(hidden, self.gate_up_proj, self.down_proj, topk_weights, topk_ids, self.packed)
        return tensor_model_parallel_all_reduce(out) if self.tp_size > 1 else out
