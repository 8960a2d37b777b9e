"""Small random checkpoints of each supported family, with a tokenizer, for benchmarks.

    python -m benchmarks.family_models OUT_DIR [family ...]     # default: every family
    llmsvc bench OUT_DIR/qwen3 --mode offline --baseline hf

Same shape for every family (hidden 256, 4 layers, 8 heads, 2 KV heads, MLP 512, vocab 512,
fp32 random weights): tokens per second then compare the engines, not the models. Mistral gets
a 64-token window (shorter than W2's prompts), Gemma 3 alternates sliding and global layers.
"""
from __future__ import annotations

import os
import sys

VOCAB = 512
SHAPE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=4096,
             bos_token_id=1, eos_token_id=2, pad_token_id=0)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=64)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        head_dim=32, query_pre_attn_scalar=32, sliding_window=64,
        layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"])),
}


def make(family: str, path: str, **overrides) -> str:
    """Write the family's small random checkpoint and a word-level tokenizer (t0..t511) to path."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models

    cls, arch, extra = FAMILIES[family]
    cfg = getattr(transformers, cls)(**{**SHAPE, **extra, **overrides})
    cfg.architectures = [arch]
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="t1", eos_token="t2",
                                         pad_token="t0").save_pretrained(path)
    return path


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        raise SystemExit(__doc__)
    out, families = argv[0], argv[1:] or list(FAMILIES)
    for f in families:
        print(make(f, os.path.join(out, f)))


if __name__ == "__main__":
    main()
