"""Vocab-parallel token embedding and LM head.

The vocabulary is split in contiguous ranges of `num_embeddings_per_partition`
= ceil(vocab / tp_size) rows; the last rank's tail rows are zero padding.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from kernels import ops
from llmsvc.models.layers.gguf import GGUFBlocksMixin
from llmsvc.models.parallel import (get_tp_rank, get_tp_world_size,
                                    tensor_model_parallel_all_gather,
                                    tensor_model_parallel_all_reduce)


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, params_dtype: torch.dtype | None = None):
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_world_size()
        self.num_embeddings = num_embeddings
        self.num_embeddings_per_partition = -(-num_embeddings // self.tp_size)
        self.vocab_start = self.tp_rank * self.num_embeddings_per_partition
        self.vocab_end = min(self.vocab_start + self.num_embeddings_per_partition, num_embeddings)
        dtype = params_dtype or torch.get_default_dtype()
        # [num_embeddings_per_partition, embedding_dim]
        self.weight = nn.Parameter(torch.zeros(self.num_embeddings_per_partition, embedding_dim, dtype=dtype),
                                   requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        if loaded_weight.shape[0] != self.num_embeddings:
            raise ValueError(f"embedding has {loaded_weight.shape[0]} rows, expected {self.num_embeddings}")
        n = self.vocab_end - self.vocab_start
        param.data[:n].copy_(loaded_weight.narrow(0, self.vocab_start, n))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # input_ids: [T] -> [T, embedding_dim]
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        mine = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local = torch.where(mine, input_ids - self.vocab_start, torch.zeros_like(input_ids))
        out = F.embedding(local, self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
        return tensor_model_parallel_all_reduce(out)


class ParallelLMHead(GGUFBlocksMixin, VocabParallelEmbedding):
    """Output projection sharded by vocab; with tied embeddings the model shares the
    embedding's parameter (`tie_weights`)."""

    packed_weight: torch.Tensor | None = None  # set by process_weights_after_loading

    def tie_weights(self, embed: VocabParallelEmbedding) -> None:
        self.weight = embed.weight
        self.shares_weight = True

    def process_weights_after_loading(self) -> None:
        """Pre-pack the (possibly tied) weight, or its GGUF blocks, for the CPU GEMM; the
        embedding keeps the original."""
        self.packed_weight = self.pack_weight()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("use compute_logits")

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [S, hidden] -> [S, vocab] float32, the full vocabulary on every rank
        logits = ops.linear(hidden, self.weight, None, self.packed_weight)
        if self.tp_size > 1:
            logits = tensor_model_parallel_all_gather(logits, dim=-1)
        return logits[..., :self.num_embeddings].float()
