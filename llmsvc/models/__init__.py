"""Model code and weight loading (layer: models; imports only kernels and llmsvc's shared modules).

Torch-free to import: the engine imports `llmsvc.models.resolve`, which needs no torch.
  resolve.py   default_model_path, resolve_model_dir (GGUF -> cached HF dir), resolve_model_config
  hf_config.py HFConfig: the transformers config as plain data, cached (json_cache.py)
  tokenizer.py load_tokenizer: AutoTokenizer's choice of class, remembered
  llama.py     LlamaForCausalLM / Qwen2ForCausalLM / MistralForCausalLM, kv_cache_spec
  loader.py    build_model (class, dtype, weights, quantization), get_model_class
  moe.py       Qwen3MoeForCausalLM / MixtralForCausalLM (experts over kernels.ops.fused_moe)
  parallel.py  tensor-parallel rank / world size and collectives
  layers/      parallel linears, vocab-parallel embedding, RoPE, paged attention, RMSNorm,
               the stacked experts of an MoE layer (fused_moe.py)
"""
