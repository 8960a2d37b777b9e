"""Mixture-of-experts decoders: Qwen3-MoE (Qwen3MoeForCausalLM) and Mixtral (MixtralForCausalLM).

The Llama decoder with each (sparse) layer's MLP replaced by a router and E experts:

  router_logits = gate(x)                                  # [T, E], gate replicated on every rank
  topk_weights, topk_ids = top-k of softmax(router_logits)  # [T, k], renormalised over the k
                                                           #   (Mixtral always, Qwen3-MoE if norm_topk_prob)
  y[t] = sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t])   (ops.fused_moe, grouped by expert)

Qwen3-MoE also normalises each head's q and k (RMSNorm over head_dim) before RoPE, has an
explicit head_dim, and keeps a dense MLP (intermediate_size) on layers listed in mlp_only_layers
or off the decoder_sparse_step grid. Parameter names follow transformers v5, which stores the
experts stacked (`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`); checkpoints name them per
expert (`mlp.experts.{e}.gate_proj` ... for Qwen3-MoE, `block_sparse_moe.experts.{e}.w1/w2/w3`
for Mixtral, whose router is `block_sparse_moe.gate`): `checkpoint_target` maps both.

The layers always run op by op: the one-call CPU decoder (kernels/cpu_ops/decoder.c) has no
MoE block, so these models never build its plan.
"""
from __future__ import annotations

import re

import torch
import torch.nn as nn

from kernels import ops
from llmsvc.models.layers.embedding import VocabParallelEmbedding
from llmsvc.models.layers.fused_moe import FusedMoE
from llmsvc.models.layers.linear import ReplicatedLinear
from llmsvc.models.layers.norm import RMSNorm
from llmsvc.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from llmsvc.models.loader_names import layer_sliding_windows

# model.layers.N.{mlp|block_sparse_moe}.experts.E.<proj>.weight
_EXPERT_TENSOR = re.compile(r"^(?P<layer>.*)\.(?:mlp|block_sparse_moe)\.experts\.(?P<e>\d+)\."
                            r"(?P<proj>gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_GATE_UP_SHARD = {"gate_proj": 0, "w1": 0, "up_proj": 1, "w3": 1}  # w2 / down_proj: the down projection


class SparseMoeBlock(nn.Module):
    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int,
                 renormalize: bool, dtype: torch.dtype):
        super().__init__()
        self.top_k, self.renormalize = top_k, renormalize
        self.gate = ReplicatedLinear(hidden_size, num_experts, False, dtype)
        self.experts = FusedMoE(num_experts, hidden_size, intermediate_size, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = ops.moe_route(self.gate(x), self.top_k, self.renormalize)  # [T, k]
        return self.experts(x, topk_weights, topk_ids)  # [T, hidden]


class MoeDecoderLayer(nn.Module):
    forward = LlamaDecoderLayer.forward  # the same pre-norm residual wiring; only the MLP differs

    def __init__(self, cfg, dtype: torch.dtype, self_attn: nn.Module, mlp: nn.Module):
        super().__init__()
        self.self_attn, self.mlp = self_attn, mlp
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)


class MoeModel(nn.Module):
    """Embedding, decoder layers, final norm. Subclasses say which layers are sparse and how
    the config names the expert counts (`moe_args`). Attention is LlamaAttention's (with
    Qwen3-MoE's per-head q/k norms and the config's sliding window)."""

    def __init__(self, cfg, dtype: torch.dtype, max_position: int):
        super().__init__()
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise NotImplementedError(f"activation {cfg.hidden_act!r} (only silu)")
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, dtype)
        windows = layer_sliding_windows(cfg)
        self.layers = nn.ModuleList(
            MoeDecoderLayer(cfg, dtype, LlamaAttention(cfg, dtype, max_position, windows[i]),
                            SparseMoeBlock(cfg.hidden_size, **self.moe_args(cfg), dtype=dtype)
                            if self.is_sparse(cfg, i) else LlamaMLP(cfg, dtype))
            for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    @staticmethod
    def moe_args(cfg) -> dict:
        """num_experts, top_k, intermediate_size (per expert), renormalize."""
        raise NotImplementedError

    @staticmethod
    def is_sparse(cfg, layer_idx: int) -> bool:
        return True

    def forward(self, input_ids, positions, meta, kv_caches):
        hidden, residual = self.embed_tokens(input_ids), None  # [T, hidden]
        for i, layer in enumerate(self.layers):
            hidden, residual = layer(positions, hidden, residual, kv_caches[i] if kv_caches else None, meta)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class Qwen3MoeModel(MoeModel):
    @staticmethod
    def moe_args(cfg) -> dict:
        return dict(num_experts=cfg.num_experts, top_k=cfg.num_experts_per_tok,
                    intermediate_size=cfg.moe_intermediate_size, renormalize=bool(cfg.norm_topk_prob))

    @staticmethod
    def is_sparse(cfg, layer_idx: int) -> bool:
        # transformers' rule; the other layers keep a dense MLP of cfg.intermediate_size
        step = getattr(cfg, "decoder_sparse_step", 1) or 1
        return (layer_idx not in (getattr(cfg, "mlp_only_layers", None) or [])
                and cfg.num_experts > 0 and (layer_idx + 1) % step == 0)


class MixtralModel(MoeModel):
    @staticmethod
    def moe_args(cfg) -> dict:
        return dict(num_experts=cfg.num_local_experts, top_k=cfg.num_experts_per_tok,
                    intermediate_size=cfg.intermediate_size, renormalize=True)


class MoeForCausalLM(LlamaForCausalLM):
    """LlamaForCausalLM's head and loader over a MoeModel; expert tensors are stacked at load."""

    model_class = MoeModel

    def checkpoint_target(self, name: str) -> tuple[str, object]:
        name = name.replace(".block_sparse_moe.", ".mlp.")
        m = _EXPERT_TENSOR.match(name)
        if m is None:
            return super().checkpoint_target(name)
        expert, proj = int(m["e"]), m["proj"]
        if proj in _GATE_UP_SHARD:
            return f"{m['layer']}.mlp.experts.gate_up_proj", (expert, _GATE_UP_SHARD[proj])
        return f"{m['layer']}.mlp.experts.down_proj", expert

    def shard_ids(self, param_name: str) -> tuple:
        if param_name.endswith(".experts.gate_up_proj"):
            return tuple((e, j) for e in range(self.num_experts) for j in (0, 1))
        if param_name.endswith(".experts.down_proj"):
            return tuple(range(self.num_experts))
        return super().shard_ids(param_name)

    @property
    def num_experts(self) -> int:
        return self.model.moe_args(self.config)["num_experts"]


class Qwen3MoeForCausalLM(MoeForCausalLM):
    model_class = Qwen3MoeModel


class MixtralForCausalLM(MoeForCausalLM):
    model_class = MixtralModel
