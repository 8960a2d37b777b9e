"""Compile time of a structured-output constraint, measured with the engine's own grammar manager."""
from __future__ import annotations

import time


def compile_seconds(model_dir: str, json_schema: str) -> tuple[float, float]:
    """(first compile, cache hit) in seconds for this JSON Schema and the model's tokenizer;
    the tokenizer view (built once per engine) is excluded."""
    from transformers import AutoTokenizer

    from llmsvc.config import ModelConfig
    from llmsvc.models.resolve import resolve_model_config
    from llmsvc.sampling_params import StructuredOutputsParams
    from llmsvc.structured.manager import StructuredOutputManager

    mc = resolve_model_config(ModelConfig(model=model_dir))
    tok = AutoTokenizer.from_pretrained(mc.model_dir)
    mgr = StructuredOutputManager(tok, mc.vocab_size, list(mc.eos_token_ids), compile_timeout_s=600)
    try:
        mgr.wait(StructuredOutputsParams(json_object=True))  # the tokenizer view is ready after this
        spec = StructuredOutputsParams(json=json_schema)
        t0 = time.perf_counter()
        mgr.wait(spec)
        cold = time.perf_counter() - t0
        t0 = time.perf_counter()
        mgr.wait(spec)
        return cold, time.perf_counter() - t0
    finally:
        mgr.shutdown()
