"""Model construction entry points (re-exported from llama.py, where the registry lives)."""
from llmsvc.models.llama import build_model, get_model_class, kv_cache_spec, to_torch_dtype

__all__ = ["build_model", "get_model_class", "kv_cache_spec", "to_torch_dtype"]
