"""Torch-free names the resolver checks before any model is built (kept in sync with loader.py)."""
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM",
                          "Qwen3MoeForCausalLM", "MixtralForCausalLM")
TORCH_DTYPE_NAMES = ("float32", "bfloat16", "float16")
