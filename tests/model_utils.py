"""Reusable helpers for tests that need a model: tiny random HF checkpoints, a paged-cache
runner over our model, and the converted default model.

    from model_utils import make_tiny_model_dir, PagedRunner   (or tests.model_utils)
"""
from __future__ import annotations

import math
import os
import random

import torch

from llmsvc.models.layers.attention import AttentionMetadata
from llmsvc.models.llama import kv_cache_spec

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=320, max_position_embeddings=256, rms_norm_eps=1e-5,
            bos_token_id=1, eos_token_id=2, pad_token_id=0)
# 8 experts, 2 per token; Qwen3-MoE's head_dim (32) differs from hidden / heads (16)
TINY_MOE = {"qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=32,
                              intermediate_size=48),
            "mixtral": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32)}


# arch -> (transformers config class, architecture, family defaults over TINY)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32)),  # explicit, != hidden / heads
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),
    # two sliding layers, then a global one; window and rope bases small enough to matter here
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        num_hidden_layers=3, head_dim=32, query_pre_attn_scalar=24, sliding_window=16,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}})),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", TINY_MOE["qwen3_moe"]),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", TINY_MOE["mixtral"]),
}


def tiny_hf_config(arch: str = "llama", tie: bool = False, **cfg):
    import transformers
    cls, architecture, family = FAMILIES[arch]
    kw = {**TINY, **family, "tie_word_embeddings": tie, **cfg}
    config = getattr(transformers, cls)(**kw)
    config.architectures = [architecture]
    return config


def make_tiny_model_dir(tmp_path, arch: str = "llama", tie: bool = False, seed: int = 0, **cfg) -> str:
    """Save a tiny random HF model (2 layers, hidden 64, 4 heads, 2 KV heads, vocab 320) as
    safetensors under tmp_path/<arch>-...; returns the directory. Weights are re-drawn with
    std 1/sqrt(fan_in) (biases and norm weights non-trivial) so logits are O(1) and any
    wiring mistake shows. No tokenizer is written."""
    import transformers
    config = tiny_hf_config(arch, tie, **cfg)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
    tag = "-".join([arch, "tied" if tie else "untied", str(seed)] + [f"{k}" for k in sorted(cfg)])
    out = os.path.join(str(tmp_path), tag)
    model.save_pretrained(out)
    return out


def load_hf_model(model_dir: str, dtype=torch.float32):
    import transformers
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype,
                                                             attn_implementation="eager").eval()


def load_our_model(model_dir: str, dtype: str = "float32", max_model_len: int | None = None,
                   device: str = "cpu", quantization: str = "none"):
    from llmsvc.config import ModelConfig
    from llmsvc.models.loader import build_model
    from llmsvc.models.resolve import resolve_model_config
    mc = resolve_model_config(ModelConfig(model=model_dir, dtype=dtype, max_model_len=max_model_len,
                                          quantization=quantization))
    return build_model(mc, device)


class PagedRunner:
    """Runs our model over a paged KV cache the way a model runner does: each `step`
    takes {seq_id: new token ids} (a whole prompt, a prefill chunk or one decode token),
    flattens them into one [T] batch, allocates blocks from a SHUFFLED free list (so a
    sequence's blocks are non-contiguous and out of order), and returns per-sequence
    logits [n_new, vocab] (or only the last row with last_only=True). Caches and step
    inputs live on the model's device."""

    def __init__(self, model, num_blocks: int = 64, block_size: int = 16, seed: int = 0):
        cfg = model.config
        num_layers, num_kv_heads, head_dim = kv_cache_spec(cfg)  # this TP rank's heads
        param = next(model.parameters())
        dtype, self.device = param.dtype, param.device
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=dtype, device=self.device),
                           torch.zeros(shape, dtype=dtype, device=self.device))
                          for _ in range(num_layers)]
        self.model, self.block_size = model, block_size
        self.free_blocks = list(range(num_blocks))
        random.Random(seed).shuffle(self.free_blocks)
        self.block_tables: dict = {}
        self.num_computed: dict = {}

    def free(self, seq_id) -> None:
        self.free_blocks.extend(self.block_tables.pop(seq_id))
        del self.num_computed[seq_id]

    @torch.no_grad()
    def step(self, batch: dict, last_only: bool = False) -> dict:
        ids, positions, slots, qsl, seq_lens, tables = [], [], [], [0], [], []
        bs = self.block_size
        for sid, tokens in batch.items():
            start = self.num_computed.setdefault(sid, 0)
            table = self.block_tables.setdefault(sid, [])
            end = start + len(tokens)
            while len(table) * bs < end:
                table.append(self.free_blocks.pop())
            ids += list(tokens)
            positions += range(start, end)
            slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
            qsl.append(qsl[-1] + len(tokens))
            seq_lens.append(end)
            tables.append(table)
            self.num_computed[sid] = end
        width = max(len(t) for t in tables)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32,
                                      device=dev),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            max_query_len=max(b - a for a, b in zip(qsl, qsl[1:])),
            max_seq_len=max(seq_lens))
        hidden = self.model(torch.tensor(ids, dtype=torch.int64, device=dev),
                            torch.tensor(positions, dtype=torch.int64, device=dev), meta, self.kv_caches)
        if last_only:
            rows = torch.tensor(qsl[1:], dtype=torch.int64, device=dev) - 1
            logits = self.model.compute_logits(hidden[rows])
            return {sid: logits[i] for i, sid in enumerate(batch)}
        logits = self.model.compute_logits(hidden)
        return {sid: logits[qsl[i]:qsl[i + 1]] for i, sid in enumerate(batch)}

    def greedy_generate(self, prompts: dict, max_new_tokens: int) -> dict:
        """All prompts prefilled in one batch, then decoded together; returns new token ids."""
        out = {sid: [] for sid in prompts}
        logits = self.step({sid: list(p) for sid, p in prompts.items()}, last_only=True)
        for _ in range(max_new_tokens):
            for sid in prompts:
                out[sid].append(int(logits[sid].argmax()))
            if len(out[next(iter(out))]) == max_new_tokens:
                break
            logits = self.step({sid: [out[sid][-1]] for sid in prompts}, last_only=True)
        return out


def converted_default_model_dir() -> str:
    """The converted default model (converted once into $LLMSVC_CACHE, default ~/.cache/llmsvc).
    Tests use the session fixture `default_model_dir` from conftest.py, which calls the same."""
    from llmsvc.models.resolve import resolve_model_dir
    return resolve_model_dir(None)
