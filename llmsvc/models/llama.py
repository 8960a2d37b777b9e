"""Llama-family decoder (Llama / SmolLM, Qwen2, Mistral, Qwen3, Phi-3) over the paged KV cache.

Parameter names follow Hugging Face except the fused projections:
  model.layers.N.self_attn.qkv_proj  <- q_proj, k_proj, v_proj   (shard ids "q", "k", "v")
  model.layers.N.mlp.gate_up_proj    <- gate_proj, up_proj       (shard ids 0, 1)
Phi-3 checkpoints are fused already (qkv_proj, gate_up_proj) and are cut into the same shards
at load. Qwen2 has a bias on q/k/v; Llama honours `attention_bias` / `mlp_bias`. Qwen3
RMS-normalises each head of q and k before RoPE (q_norm, k_norm over head_dim). Sliding
windows come per layer from `layer_sliding_windows` (Mistral and Phi-3: every layer; Qwen2/3:
the layers `layer_types` marks) and are honoured by every attention path.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from kernels import ops
from llmsvc.models.layers.activation import SiluAndMul
from llmsvc.models.layers.attention import Attention, AttentionMetadata
from llmsvc.models.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from llmsvc.models.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from llmsvc.models.layers.norm import RMSNorm
from llmsvc.models.layers.rotary import get_rope
from llmsvc.models.loader_names import layer_sliding_windows
from llmsvc.models.parallel import get_tp_world_size
from llmsvc.models.tp_split import check_tensor_parallel
from llmsvc.models.weights import load_checkpoint

KVCache = tuple[torch.Tensor, torch.Tensor]  # (k_cache, v_cache): [num_blocks, block_size, Hkv_rank, D]


def head_dim_of(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


class LlamaMLP(nn.Module):
    def __init__(self, cfg, dtype: torch.dtype):
        super().__init__()
        bias = bool(getattr(cfg, "mlp_bias", False))
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise NotImplementedError(f"activation {cfg.hidden_act!r} (only silu)")
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2, bias, dtype)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, bias, params_dtype=dtype)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))  # [T, hidden]


def per_head_rms_norm(norm: RMSNorm, x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """x: [T, H * head_dim] (rows may be strided) -> [T, H * head_dim] contiguous, each head
    normalised on its own (Qwen3 / Gemma 3 q_norm, k_norm)."""
    t = x.shape[0]
    return norm(x.reshape(t * (x.shape[1] // head_dim), head_dim)).view(t, -1)


class LlamaAttention(nn.Module):
    def __init__(self, cfg, dtype: torch.dtype, max_position: int, sliding_window: int = 0):
        super().__init__()
        self.head_dim = head_dim_of(cfg)
        attention_bias = bool(getattr(cfg, "attention_bias", False))
        qkv_bias = attention_bias or cfg.model_type == "qwen2"
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, self.head_dim, cfg.num_attention_heads,
                                          cfg.num_key_value_heads, qkv_bias, dtype)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * self.head_dim, cfg.hidden_size,
                                        attention_bias, params_dtype=dtype)
        if cfg.model_type in ("qwen3", "qwen3_moe"):
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype)
        else:
            self.q_norm = self.k_norm = None
        self.rotary_emb = get_rope(cfg, self.head_dim, max_position)
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim ** -0.5, self.num_kv_heads,
                              sliding_window=sliding_window)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, kv_cache: KVCache | None,
                meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)  # [T, (Hq + 2 Hkv) * D] (this rank's heads)
        qk = self.q_size + self.kv_size
        q, k, v = qkv[:, :self.q_size], qkv[:, self.q_size:qk], qkv[:, qk:]  # views
        if self.q_norm is not None:  # Qwen3 / Qwen3-MoE: [T, H * D] -> the same, each head RMS-normalised
            q = per_head_rms_norm(self.q_norm, q, self.head_dim)
            k = per_head_rms_norm(self.k_norm, k, self.head_dim)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v, kv_cache, meta))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg, dtype: torch.dtype, max_position: int, sliding_window: int = 0):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, dtype, max_position, sliding_window)
        self.mlp = LlamaMLP(cfg, dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def forward(self, positions, hidden, residual, kv_cache, meta):
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg, dtype: torch.dtype, max_position: int):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, dtype)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, dtype, max_position, window)
                                    for window in layer_sliding_windows(cfg))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self._native_plan = None  # ops.decoder_layers_plan, made at the first forward (weights packed)
        self._native_planned = False
        self.lora_manager = None  # llmsvc.models.lora.LoRAManager when adapters are served

    def _native_out(self, hidden, positions, meta, kv_caches):
        """The native whole-stack call's (hidden, residual), or None: layer by layer (also when
        the step's LoRA adapters have weights the native GEMMs cannot take)."""
        if not self._native_planned:
            self._native_plan, self._native_planned = self._make_native_plan(), True
        lora = None
        if self._native_plan is not None and self.lora_manager is not None and self.lora_manager.active:
            lora = self.lora_manager.native(self.layers)
            if lora is None:
                return None
        return ops.decoder_layers(self._native_plan, hidden, positions, meta, kv_caches, lora)

    def forward(self, input_ids, positions, meta, kv_caches):
        hidden, residual = self.embed_tokens(input_ids), None  # [T, hidden]
        out = self._native_out(hidden, positions, meta, kv_caches)
        if out is not None:
            hidden, residual = out
        else:
            for i, layer in enumerate(self.layers):
                hidden, residual = layer(positions, hidden, residual, kv_caches[i] if kv_caches else None, meta)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def _make_native_plan(self):
        """All layers in one native call (CPU) where every layer fits it: no TP, no bias
        beyond q/k/v, no q/k norm, one norm eps, one rope table and one sliding window for
        every layer. Otherwise None: the layers run one op at a time."""
        first = self.layers[0]
        attn, mlp = first.self_attn, first.mlp
        rope = attn.rotary_emb.cos_sin_cache
        for l in self.layers:
            if (l.self_attn.o_proj.bias is not None or l.self_attn.q_norm is not None
                    or l.self_attn.attn.sliding_window != attn.attn.sliding_window
                    or l.mlp.gate_up_proj.bias is not None or l.mlp.down_proj.bias is not None or l.input_layernorm.eps != first.input_layernorm.eps
                    or l.post_attention_layernorm.eps != first.input_layernorm.eps
                    or not torch.equal(l.self_attn.rotary_emb.cos_sin_cache, rope)):
                return None
        if get_tp_world_size() > 1:
            return None
        weights = [ops.DecoderLayerWeights(
            l.input_layernorm.weight.data, l.post_attention_layernorm.weight.data,
            l.self_attn.qkv_proj.packed_weight,
            None if l.self_attn.qkv_proj.bias is None else l.self_attn.qkv_proj.bias.data,
            l.self_attn.o_proj.packed_weight, l.mlp.gate_up_proj.packed_weight,
            l.mlp.down_proj.packed_weight) for l in self.layers]
        return ops.decoder_layers_plan(
            weights, self.norm.weight.dtype, self.norm.weight.shape[0], attn.num_heads, attn.num_kv_heads,
            attn.head_dim, mlp.down_proj.weight.shape[1], first.input_layernorm.eps,
            rope, attn.attn.scale, attn.attn.sliding_window)


class LlamaForCausalLM(nn.Module):
    # HF checkpoint name -> (our fused parameter, shard id)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    model_class: type[nn.Module] = LlamaModel  # the decoder stack; MoE models bring their own

    def __init__(self, hf_config, dtype: torch.dtype = torch.float32, max_position: int | None = None):
        super().__init__()
        self.config = hf_config
        self.dtype = dtype
        max_position = max_position or hf_config.max_position_embeddings
        self.model = self.model_class(hf_config, dtype, max_position)
        self.lm_head = ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size, dtype)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.tie_weights(self.model.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[KVCache] | None) -> torch.Tensor:
        """input_ids, positions: [T] int64 (flattened batch) -> hidden states [T, hidden]."""
        return self.model(input_ids, positions, meta, kv_caches)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [S, hidden] (only rows that sample) -> [S, vocab] float32 on every rank."""
        return self.lm_head.compute_logits(hidden)

    def checkpoint_splits(self) -> dict:
        """{hf module: [(shard id, rows)]} for checkpoint tensors that hold fused projections."""
        return {}

    def load_weights(self, model_dir: str) -> None:
        """Load the checkpoint's safetensors (see llmsvc/models/weights.py); raises if a
        parameter is left unloaded or a tensor has no parameter."""
        load_checkpoint(self, model_dir, self.checkpoint_splits(), self.tie_word_embeddings)

    def checkpoint_target(self, name: str) -> tuple[str, object]:
        """(our parameter name, shard id for its weight_loader) of checkpoint tensor `name`."""
        for hf_name, (fused, sid) in self.packed_modules_mapping.items():
            if f".{hf_name}." in name:
                return name.replace(f".{hf_name}.", f".{fused}."), sid
        return name, None

    def shard_ids(self, param_name: str) -> tuple:
        """The shard ids under which a parameter's checkpoint tensors arrive (None: one tensor)."""
        if param_name.endswith(("qkv_proj.weight", "qkv_proj.bias")):
            return ("q", "k", "v")
        if param_name.endswith(("gate_up_proj.weight", "gate_up_proj.bias")):
            return (0, 1)
        return (None,)


class Qwen2ForCausalLM(LlamaForCausalLM):
    pass


class MistralForCausalLM(LlamaForCausalLM):
    pass


class Qwen3ForCausalLM(LlamaForCausalLM):
    pass


class Phi3ForCausalLM(LlamaForCausalLM):
    def checkpoint_splits(self) -> dict:
        cfg = self.config
        d = head_dim_of(cfg)
        q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
        return {"qkv_proj": [("q", q), ("k", kv), ("v", kv)],
                "gate_up_proj": [(0, cfg.intermediate_size), (1, cfg.intermediate_size)]}


def kv_cache_spec(hf_config, tp_size: int | None = None) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads_per_rank, head_dim) for allocating the per-layer caches."""
    tp = tp_size or get_tp_world_size()
    total_kv = hf_config.num_key_value_heads or hf_config.num_attention_heads
    check_tensor_parallel(hf_config, tp)
    return hf_config.num_hidden_layers, max(1, total_kv // tp), head_dim_of(hf_config)
