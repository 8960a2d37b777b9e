"""Torch-free model registry: what the resolver checks before any model is built.

ARCHITECTURES maps an HF `architectures` entry to "module:class" (imported only when a model
is built); MODEL_TYPES maps a config's model_type to its architecture, for configs that name
none. One line per family: add a family by adding its lines here.
"""
ARCHITECTURES = {
    "LlamaForCausalLM": "llmsvc.models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "llmsvc.models.llama:Qwen2ForCausalLM",
    "MistralForCausalLM": "llmsvc.models.llama:MistralForCausalLM",
    "Qwen3ForCausalLM": "llmsvc.models.llama:Qwen3ForCausalLM",
    "Phi3ForCausalLM": "llmsvc.models.llama:Phi3ForCausalLM",
    "Gemma3ForCausalLM": "llmsvc.models.gemma3:Gemma3ForCausalLM",
    "Qwen3MoeForCausalLM": "llmsvc.models.moe:Qwen3MoeForCausalLM",
    "MixtralForCausalLM": "llmsvc.models.moe:MixtralForCausalLM",
}
MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)


def layer_sliding_windows(hf_config) -> list[int]:
    """Per decoder layer, the sliding window its attention uses in transformers (0: full
    attention). A config with `layer_types` (Qwen2/3, Gemma 3) windows its
    "sliding_attention" layers; otherwise a `sliding_window` windows every layer (Mistral,
    Phi-3, Mixtral), except for Qwen2/3 and Qwen3-MoE, whose window needs use_sliding_window."""
    n = hf_config.num_hidden_layers
    window = int(getattr(hf_config, "sliding_window", None) or 0)
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types:
        return [window if t == "sliding_attention" else 0 for t in layer_types[:n]]
    if hf_config.model_type in ("qwen2", "qwen3", "qwen3_moe") and not getattr(hf_config, "use_sliding_window", False):
        return [0] * n
    return [window] * n


def kv_release_window(hf_config) -> int | None:
    """The window the KV manager may free blocks behind: the widest layer window when every
    layer has one, else None (a full-attention layer reads the whole context). hf_config None
    (fake engines in tests): None."""
    if hf_config is None:
        return None
    windows = layer_sliding_windows(hf_config)
    return max(windows) if windows and min(windows) > 0 else None
