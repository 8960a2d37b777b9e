"""Configuration dataclasses every layer reads (torch-free, picklable).

The entry points (offline `LLM`, `llmsvc serve`) build an `EngineConfig`, resolve the
model once (`llmsvc.models.resolve.resolve_model_config`, which fills the fields marked
"resolved"), and hand the same object to the engine, the executor and every worker.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ModelConfig:
    model: str | None = None  # HF directory or .gguf file; None = default SmolLM2-135M-Instruct GGUF
    dtype: str = "float32"  # float32 | bfloat16 | float16
    max_model_len: int | None = None  # None = the model's max_position_embeddings
    seed: int = 0
    enforce_eager: bool = False  # CUDA: never capture decode steps in CUDA graphs
    # resolved (filled by resolve_model_config; never set by users)
    model_dir: str | None = None  # HF-style directory: config.json, *.safetensors, tokenizer files
    hf_config: Any = None  # transformers.PretrainedConfig
    architecture: str = ""
    vocab_size: int = 0
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    generation_defaults: dict = field(default_factory=dict)  # from generation_config.json

    @property
    def served_model_name(self) -> str:
        return self.model or "SmolLM2-135M-Instruct"


@dataclass
class CacheConfig:
    block_size: int = 16
    kv_cache_memory_bytes: int = 2 << 30  # CPU: KV budget; GPU: ignored unless set explicitly
    gpu_memory_utilization: float = 0.90
    num_kv_blocks_override: int | None = None  # tests: force a tiny pool
    enable_prefix_caching: bool = True


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 1024  # token budget per step (prefill chunks + decodes)
    max_waiting_requests: int = 4096  # admission cap; past it new requests are rejected
    policy: str = "fcfs"  # fcfs | priority
    enable_chunked_prefill: bool = True


@dataclass
class ParallelConfig:
    executor: str = "uniproc"  # uniproc | multiproc | tp
    tensor_parallel_size: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 0  # 0 = pick a free port (single node)
    nnodes: int = 1
    node_rank: int = 0


@dataclass
class EngineConfig:
    model_config: ModelConfig = field(default_factory=ModelConfig)
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    device: str = "auto"  # auto (cuda if available, else cpu) | cpu | cuda
    log_stats_interval_s: float = 10.0
    max_stop_strings: int = 64
    max_n: int = 16
    engine_core: str = "inline"  # inline: EngineCore in the caller's process | process: its own, over ZeroMQ

    def replace(self, **kw) -> "EngineConfig":
        return dataclasses.replace(self, **kw)
