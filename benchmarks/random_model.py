"""A copy of a model with random weights: its config, tokenizer and generation config, and
freshly initialised safetensors (transformers' own initialisation, seed 0). The arithmetic of
every step is the real model's, so it stands in for the model where its weights cannot travel
(the GPU benchmarks in docs/gpu.md ran on such a copy of SmolLM2-135M-Instruct).

    .venv/bin/python -m benchmarks.random_model OUT_DIR [--model MODEL] [--dtype float32]

MODEL is a Hugging Face directory (its weights may be missing) or a .gguf file (default: SmolLM2-135M-Instruct's GGUF,
converted once as `llmsvc serve` does).
"""
from __future__ import annotations

import argparse
import os
import shutil

COPIED = ("chat_template.jinja", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
          "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt")


def write_random_model(model: str | None, out_dir: str, dtype: str = "float32", seed: int = 0) -> str:
    import torch
    import transformers

    from llmsvc.models.resolve import resolve_model_dir

    # a directory with a config and no weights (a model's config and tokenizer files) will do
    src = model if model and os.path.isfile(os.path.join(model, "config.json")) else resolve_model_dir(model)
    config = transformers.AutoConfig.from_pretrained(src)
    torch.manual_seed(seed)
    m = transformers.AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    m.save_pretrained(out_dir, safe_serialization=True)
    for name in COPIED:
        if os.path.isfile(os.path.join(src, name)):
            shutil.copy(os.path.join(src, name), os.path.join(out_dir, name))
    return out_dir


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir")
    p.add_argument("--model", default=None, help="HF directory or .gguf (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    print(write_random_model(a.model, a.out_dir, a.dtype, a.seed))


if __name__ == "__main__":
    main()
