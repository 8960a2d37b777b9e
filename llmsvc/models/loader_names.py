"""Torch-free names the resolver checks before any model is built (kept in sync with llama.py)."""
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
