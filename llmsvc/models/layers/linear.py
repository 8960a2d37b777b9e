"""Tensor-parallel linear layers (Megatron style) with per-parameter weight loaders.

Every parameter carries `weight_loader(param, loaded_weight, shard_id=None)`: it takes
the FULL Hugging Face tensor and copies this rank's shard into `param`. Weights are
stored as in nn.Linear: [output_size_per_rank, input_size_per_rank].

  ColumnParallelLinear       output dim sharded; output stays sharded (no gather)
  MergedColumnParallelLinear several column-parallel outputs fused (gate_up); shard_id = index
  QKVParallelLinear          fused q, k, v; shard_id in {"q", "k", "v"}; KV heads replicated
                             when tp_size > num_kv_heads so every rank owns >= 1 KV head
  RowParallelLinear          input dim sharded; partial outputs all-reduced, then bias added
"""
from __future__ import annotations

import torch
import torch.nn as nn

from kernels import ops
from llmsvc.models.layers.gguf import GGUFBlocksMixin
from llmsvc.models.parallel import (divide, get_tp_rank, get_tp_world_size,
                                    tensor_model_parallel_all_reduce)


def _check_rows(loaded: torch.Tensor, rows: int) -> None:
    """A checkpoint tensor is cut into this rank's rows by narrow(), which would drop extra
    rows without a word: its row count must be the layer's."""
    if loaded.shape[0] != rows:
        raise ValueError(f"weight shape {tuple(loaded.shape)} does not fit the layer's {rows} outputs")


def _copy(param: torch.Tensor, shard: torch.Tensor) -> None:
    if param.shape != shard.shape:
        raise ValueError(f"weight shape {tuple(shard.shape)} does not fit parameter {tuple(param.shape)}")
    param.data.copy_(shard)


class LinearBase(GGUFBlocksMixin, nn.Module):
    def __init__(self, input_size: int, output_size: int, bias: bool, tp_dim: int | None,
                 params_dtype: torch.dtype | None = None):
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_world_size()
        self.tp_dim = tp_dim  # which dim of the weight is sharded (0: output, 1: input)
        dtype = params_dtype or torch.get_default_dtype()
        self.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size, dtype=dtype), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)
        self.packed_weight: torch.Tensor | None = None  # set by process_weights_after_loading
        self.lora = None  # llmsvc.models.lora.LoRALayer where an adapter touches this layer

    def process_weights_after_loading(self) -> None:
        """Once the weights are final: pre-pack them (or their GGUF blocks) for the CPU GEMM
        where that applies."""
        self.packed_weight = self.pack_weight()

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        raise NotImplementedError

    def checkpoint_rows(self, shard_id=None) -> int:
        """Rows (outputs) of the whole checkpoint tensor that weight_loader(..., shard_id) takes
        its part of (it narrows; a tensor with more rows would lose them silently)."""
        return self.output_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = ops.linear(x, self.weight, self.bias, self.packed_weight)
        if self.lora is not None:
            self.lora.add_(y, x)
        return y


class ReplicatedLinear(LinearBase):
    """Not sharded: every rank holds the whole weight."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, params_dtype=None):
        super().__init__(input_size, output_size, bias, None, params_dtype)

    def weight_loader(self, param, loaded_weight, shard_id=None):
        _copy(param, loaded_weight)


class ColumnParallelLinear(LinearBase):
    """y[:, rank's slice] = x @ W[rank's rows].T (+ b[rank's slice]); input replicated."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, params_dtype=None):
        tp = get_tp_world_size()
        super().__init__(input_size, divide(output_size, tp), bias, 0, params_dtype)
        self.total_output_size = output_size

    def weight_loader(self, param, loaded_weight, shard_id=None):
        _check_rows(loaded_weight, self.checkpoint_rows())
        n = param.shape[0]
        _copy(param, loaded_weight.narrow(0, self.tp_rank * n, n))

    def checkpoint_rows(self, shard_id=None) -> int:
        return self.total_output_size


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Column-parallel outputs of several matrices concatenated per rank: [gate_r | up_r]."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False, params_dtype=None):
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias, params_dtype)

    def weight_loader(self, param, loaded_weight, shard_id=None):
        _check_rows(loaded_weight, self.checkpoint_rows(shard_id))
        if shard_id is None:  # an already fused checkpoint tensor: load each part in turn
            start = 0
            for i, size in enumerate(self.output_sizes):
                self.weight_loader(param, loaded_weight.narrow(0, start, size), i)
                start += size
            return
        size = self.output_sizes[shard_id] // self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        _copy(param.data.narrow(0, offset, size), loaded_weight.narrow(0, self.tp_rank * size, size))

    def checkpoint_rows(self, shard_id=None) -> int:
        return self.total_output_size if shard_id is None else self.output_sizes[shard_id]


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q, k, v projection. Per rank the output is [q_r | k_r | v_r] with
    q_r: num_heads * head_size, k_r, v_r: num_kv_heads * head_size.

    tp_size <= total_num_kv_heads: KV heads are split (total_num_kv_heads % tp_size == 0).
    tp_size > total_num_kv_heads: each KV head is replicated on tp_size / total_num_kv_heads
    consecutive ranks (tp_size % total_num_kv_heads == 0), one KV head per rank.
    """

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int,
                 total_num_kv_heads: int | None = None, bias: bool = False, params_dtype=None):
        tp = get_tp_world_size()
        total_num_kv_heads = total_num_kv_heads or total_num_heads
        self.head_size = head_size
        self.total_num_heads, self.total_num_kv_heads = total_num_heads, total_num_kv_heads
        self.num_heads = divide(total_num_heads, tp)
        if tp >= total_num_kv_heads:
            self.num_kv_heads = 1
            self.num_kv_head_replicas = divide(tp, total_num_kv_heads)
        else:
            self.num_kv_heads = divide(total_num_kv_heads, tp)
            self.num_kv_head_replicas = 1
        self.q_size = self.num_heads * head_size
        self.kv_size = self.num_kv_heads * head_size
        output_size = (self.num_heads + 2 * self.num_kv_heads) * tp * head_size
        super().__init__(hidden_size, output_size, bias, params_dtype)

    def weight_loader(self, param, loaded_weight, shard_id=None):
        _check_rows(loaded_weight, self.checkpoint_rows(shard_id))
        if shard_id is None:  # fused checkpoint tensor [q | k | v] (full sizes)
            q = self.total_num_heads * self.head_size
            kv = self.total_num_kv_heads * self.head_size
            for sid, start, size in (("q", 0, q), ("k", q, kv), ("v", q + kv, kv)):
                self.weight_loader(param, loaded_weight.narrow(0, start, size), sid)
            return
        if shard_id == "q":
            offset, size, idx = 0, self.q_size, self.tp_rank
        elif shard_id == "k":
            offset, size, idx = self.q_size, self.kv_size, self.tp_rank // self.num_kv_head_replicas
        elif shard_id == "v":
            offset, size = self.q_size + self.kv_size, self.kv_size
            idx = self.tp_rank // self.num_kv_head_replicas
        else:
            raise ValueError(f"unknown qkv shard id {shard_id!r}")
        _copy(param.data.narrow(0, offset, size), loaded_weight.narrow(0, idx * size, size))

    def checkpoint_rows(self, shard_id=None) -> int:
        q, kv = self.total_num_heads * self.head_size, self.total_num_kv_heads * self.head_size
        return {None: q + 2 * kv, "q": q, "k": kv, "v": kv}[shard_id]


class RowParallelLinear(LinearBase):
    """y = all_reduce(x[:, rank's slice] @ W[:, rank's slice].T) + b; x arrives sharded."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 reduce_results: bool = True, params_dtype=None):
        tp = get_tp_world_size()
        super().__init__(divide(input_size, tp), output_size, bias, 1, params_dtype)
        self.total_input_size = input_size
        self.reduce_results = reduce_results

    def weight_loader(self, param, loaded_weight, shard_id=None):
        if param.dim() == 1:  # bias: replicated, added once after the reduction
            _copy(param, loaded_weight)
            return
        n = param.shape[1]  # this rank's columns (of the weight, or of GGUF block scales)
        if loaded_weight.shape[1] != n * self.tp_size:  # narrow() would drop extra columns
            raise ValueError(f"weight shape {tuple(loaded_weight.shape)} does not fit the layer's "
                             f"{n * self.tp_size} inputs")
        _copy(param, loaded_weight.narrow(1, self.tp_rank * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = ops.linear(x, self.weight, None, self.packed_weight)
        if self.lora is not None:  # this rank's share of the update, summed by the all-reduce
            self.lora.add_(y, x)
        if self.reduce_results and self.tp_size > 1:
            y = tensor_model_parallel_all_reduce(y)
        if self.bias is not None:
            y = y + self.bias
        return y
