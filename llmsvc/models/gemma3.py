"""Gemma 3 text decoder (Gemma3ForCausalLM, model_type gemma3_text) over the paged KV cache.

What differs from the Llama family (llama.py), each as transformers' Gemma3 does it:
  - RMSNorm scales by (1 + w), in fp32, rounded to the model dtype after the product;
  - sandwich norms: input / post_attention norms around attention, pre / post_feedforward
    norms around the MLP, the residual added after each post norm;
  - q_norm / k_norm per head (Gemma RMSNorm over head_dim) before RoPE;
  - the attention scale is query_pre_attn_scalar ** -0.5, not head_dim ** -0.5;
  - layer_types interleave sliding-window layers (local RoPE base) and full-attention
    layers (global base and the config's scaling): one RoPE table per layer type;
  - logits soft-capped by final_logit_softcapping when set. attn_logit_softcapping is read
    but not applied, as in transformers' Gemma3 (its attention never passes it on; every
    released Gemma 3 config leaves it null); the attention kernels support a cap (soft_cap);
  - gate activation tanh-GELU; input embeddings scaled by sqrt(hidden_size) (rounded to the
    model dtype first); LM head tied to the embeddings unless the config says otherwise.
It never takes the CPU one-call decoder path (kernels/cpu_ops/decoder.c covers Llama's layer
shape only): every layer runs op by op.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from kernels import ops
from llmsvc.models.layers.attention import Attention, AttentionMetadata
from llmsvc.models.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from llmsvc.models.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from llmsvc.models.layers.rotary import RotaryEmbedding, get_rope
from llmsvc.models.llama import KVCache, LlamaForCausalLM, head_dim_of, per_head_rms_norm
from llmsvc.models.loader_names import layer_sliding_windows


class GemmaRMSNorm(nn.Module):
    """rms_norm(x) * (1 + weight). `weight` holds the checkpoint's value (HF name); the fp32
    (1 + weight) the kernels multiply by is made once after loading."""

    def __init__(self, hidden_size: int, eps: float, params_dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(hidden_size, dtype=params_dtype), requires_grad=False)
        self.register_buffer("scale", torch.ones(hidden_size, dtype=torch.float32), persistent=False)

    def process_weights_after_loading(self) -> None:
        self.scale = 1.0 + self.weight.data.float()  # [hidden] fp32

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """As RMSNorm.forward: rms_norm(x), or (rms_norm(x + residual), x + residual)."""
        if residual is None:
            return ops.rms_norm(x, self.scale, self.eps)
        return ops.fused_add_rms_norm(x, residual, self.scale, self.eps)


class Gemma3MLP(nn.Module):
    def __init__(self, cfg, dtype: torch.dtype):
        super().__init__()
        act = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", "gelu_pytorch_tanh")
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise NotImplementedError(f"activation {act!r} (only gelu_pytorch_tanh)")
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2, False, dtype)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, False, params_dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # [T, I] each
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma3Attention(nn.Module):
    def __init__(self, cfg, dtype: torch.dtype, rope: RotaryEmbedding, sliding_window: int):
        super().__init__()
        self.head_dim = head_dim_of(cfg)
        bias = bool(getattr(cfg, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, self.head_dim, cfg.num_attention_heads,
                                          cfg.num_key_value_heads, bias, dtype)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads  # this rank's
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * self.head_dim, cfg.hidden_size, bias,
                                        params_dtype=dtype)
        self.q_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps, dtype)
        self.k_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps, dtype)
        self.rotary_emb = rope  # shared by every layer of this layer type
        self.attn = Attention(self.num_heads, self.head_dim, cfg.query_pre_attn_scalar ** -0.5, self.num_kv_heads,
                              sliding_window=sliding_window)

    def forward(self, positions, hidden, kv_cache: KVCache | None, meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)  # [T, (Hq + 2 Hkv) * D]
        qk = self.q_size + self.kv_size
        q = per_head_rms_norm(self.q_norm, qkv[:, :self.q_size], self.head_dim)
        k = per_head_rms_norm(self.k_norm, qkv[:, self.q_size:qk], self.head_dim)
        ops.rotary_embedding(positions, q, k, self.rotary_emb.cos_sin_cache, self.head_dim)
        return self.o_proj(self.attn(q, k, qkv[:, qk:], kv_cache, meta))


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg, dtype: torch.dtype, rope: RotaryEmbedding, sliding_window: int):
        super().__init__()
        self.self_attn = Gemma3Attention(cfg, dtype, rope, sliding_window)
        self.mlp = Gemma3MLP(cfg, dtype)
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(h, eps, dtype)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps, dtype)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps, dtype)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps, dtype)

    def forward(self, positions, hidden, residual, kv_cache, meta):
        """hidden: the previous layer's post-feedforward output (the embeddings for layer 0,
        residual None); returns this layer's (post-feedforward output, residual stream)."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(positions, hidden, kv_cache, meta))
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class Gemma3Model(nn.Module):
    def __init__(self, cfg, dtype: torch.dtype, max_position: int):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, dtype)
        self.embed_scale = torch.tensor(cfg.hidden_size ** 0.5).to(dtype).item()  # HF rounds it to the dtype
        d = head_dim_of(cfg)
        # [max_position, rotary_dim] tables, one per layer type (local base / global base + scaling)
        self.rope_local = get_rope(cfg, d, max_position, layer_type="sliding_attention")
        self.rope_global = get_rope(cfg, d, max_position, layer_type="full_attention")
        layer_types = getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(cfg, dtype, self.rope_local if t == "sliding_attention" else self.rope_global, w)
            for t, w in zip(layer_types, layer_sliding_windows(cfg)))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def forward(self, input_ids, positions, meta, kv_caches):
        hidden, residual = self.embed_tokens(input_ids) * self.embed_scale, None  # [T, hidden]
        for i, layer in enumerate(self.layers):
            hidden, residual = layer(positions, hidden, residual, kv_caches[i] if kv_caches else None, meta)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Same loading and interface as the Llama family (fused q/k/v and gate/up shards)."""

    def __init__(self, hf_config, dtype: torch.dtype = torch.float32, max_position: int | None = None):
        nn.Module.__init__(self)
        self.config = hf_config
        self.dtype = dtype
        self.model = Gemma3Model(hf_config, dtype, max_position or hf_config.max_position_embeddings)
        self.lm_head = ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size, dtype)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", True))
        if self.tie_word_embeddings:
            self.lm_head.tie_weights(self.model.embed_tokens)
        self.final_soft_cap = float(getattr(hf_config, "final_logit_softcapping", None) or 0.0)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head.compute_logits(hidden)  # [S, vocab] fp32
        if self.final_soft_cap:
            logits = torch.tanh(logits / self.final_soft_cap) * self.final_soft_cap
        return logits
