"""The StructuredOutputManager of an engine: built beside each EngineCore (in its process) and by
the front end (LLMEngine) for validation and compile errors; one object when both share a process."""
from __future__ import annotations

from llmsvc.config import EngineConfig


def model_eos_token_ids(config: EngineConfig, tokenizer) -> list[int]:
    """The ids that end generation: the resolved model's (generation_config, else config.json,
    and the tokenizer's EOS as its files name it: resolve_model_config), which the worker's
    min_tokens mask uses too; the loaded tokenizer's EOS only where the model names none."""
    eos = list(config.model_config.eos_token_ids)
    if not eos and getattr(tokenizer, "eos_token_id", None) is not None:
        eos = [tokenizer.eos_token_id]
    return eos


def model_vocab_size(config: EngineConfig, tokenizer) -> int:
    """Rows of the LM head (the logits' width); the tokenizer's length when the config says none."""
    return config.model_config.vocab_size or (len(tokenizer) if tokenizer is not None else 0)


def build_structured_output_manager(config: EngineConfig, tokenizer):
    """The grammar manager, or None where llguidance or a fast tokenizer is missing (then every
    constrained request is refused at validation)."""
    from llmsvc import structured

    if tokenizer is None or not getattr(tokenizer, "is_fast", False) or not structured.available():
        return None
    from llmsvc.structured.manager import StructuredOutputManager

    return StructuredOutputManager(tokenizer, model_vocab_size(config, tokenizer),
                                   model_eos_token_ids(config, tokenizer),
                                   compile_timeout_s=config.grammar_compile_timeout_s,
                                   cache_size=config.grammar_cache_size)
