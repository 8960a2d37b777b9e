"""Configuration dataclasses every layer reads (torch-free, picklable).

The entry points (offline `LLM`, `llmsvc serve`) build an `EngineConfig`, resolve the
model once (`llmsvc.models.resolve.resolve_model_config`, which fills the fields marked
"resolved"), and hand the same object to the engine, the executor and every worker.
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any

from llmsvc.speculative_config import SpeculativeConfig  # EngineConfig's; importable from here too

# K/M/G/T and KiB/MiB/GiB/TiB are binary (powers of 1024), KB/MB/GB/TB decimal: "2G" == "2GiB"
_MEMORY_UNITS = {"": 1, "b": 1}
for _i, _p in enumerate("kmgt", start=1):
    _MEMORY_UNITS.update({_p: 1024 ** _i, _p + "ib": 1024 ** _i, _p + "b": 1000 ** _i})
DTYPES = ("float32", "bfloat16", "float16")  # ModelConfig.dtype names; torch's via models.llama.to_torch_dtype
# what --dtype accepts: "auto" is the checkpoint's own dtype, resolved by resolve_model_config
DTYPE_CHOICES = ("auto", *DTYPES)
# auto: gguf where it applies (a .gguf model computed in float32 on the CPU), else none, as vLLM
# runs a GGUF's blocks by default (models/resolve.py, resolve_quantization); none: every weight
# dequantized to the compute dtype at load; gguf: a GGUF's Q4_0 ... Q8_0, Q4_K, Q5_K and Q6_K
# linear weights multiplied as blocks on the CPU, in float32 (models/gguf_blocks.py); int8: linear
# weights quantized per channel at load, activations per token (CPU, models/int8_weights.py)
QUANTIZATION_CHOICES = ("auto", "none", "gguf", "int8")
MEMORY_SIZE_HELP = "K/M/G/T and KiB/MiB/GiB/TiB are powers of 1024, KB/MB/GB/TB powers of 1000"


def num_threads_env() -> int | None:
    """LLMSVC_NUM_THREADS, the compute threads each worker gives torch (the Kubernetes manifest
    sets it from the pod's CPU request); unset or empty: torch's default, every core. Anything
    but a whole number >= 1 is a ValueError naming the variable."""
    v = os.environ.get("LLMSVC_NUM_THREADS", "").strip()
    if not v:
        return None
    if not v.isdigit() or int(v) < 1:
        raise ValueError(f"LLMSVC_NUM_THREADS={v!r}: must be a whole number of threads >= 1")
    return int(v)


def parse_memory(value: int | str) -> int:
    """Bytes from an int or a string like "512MiB", "2G" (= 2GiB), "1.5GB" (decimal). ValueError if bad."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _MEMORY_UNITS:
        raise ValueError(f"cannot parse memory size {value!r} (e.g. 2GiB, 512MiB; {MEMORY_SIZE_HELP})")
    return int(float(m.group(1)) * _MEMORY_UNITS[m.group(2).lower()])


@dataclass
class ModelConfig:
    model: str | None = None  # HF directory or .gguf file; None = default SmolLM2-135M-Instruct GGUF
    served_name: str | None = None  # the name clients see (GetModelInfo, logs); None = `model` as given
    tokenizer: str | None = None  # a directory of tokenizer files to use instead of the model's
    dtype: str = "auto"  # one of DTYPE_CHOICES; resolved to one of DTYPES (models/resolve.py)
    max_model_len: int | None = None  # None = the model's max_position_embeddings
    seed: int = 0
    chat_template: str | None = None  # Jinja text or a file of it, replacing the model's; resolved to the text
    enforce_eager: bool = False  # CUDA: never capture decode steps in CUDA graphs
    # where unset sampling fields take their defaults: "auto" (the model's generation_config.json),
    # "vllm" (none: the neutral values), or a directory holding a generation_config.json / a JSON file
    generation_config: str = "auto"
    override_generation_config: dict | None = None  # e.g. {"temperature": 0.5}, over the above
    quantization: str = "auto"  # one of QUANTIZATION_CHOICES; "auto" resolved to one of the others
    # resolved (filled by resolve_model_config; never set by users)
    model_source: str = ""  # `model` as given, or the default GGUF's path: what GetModelInfo.model_id names
    model_dir: str | None = None  # HF-style directory: config.json, *.safetensors, tokenizer files
    hf_config: Any = None  # llmsvc.models.hf_config.HFConfig (or a transformers config, in tests)
    architecture: str = ""
    vocab_size: int = 0
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    generation_defaults: dict = field(default_factory=dict)  # from generation_config.json

    @property
    def tokenizer_dir(self) -> str | None:
        """Where the tokenizer is loaded from: `tokenizer`, else the model's directory."""
        return self.tokenizer or self.model_dir

    @property
    def served_model_name(self) -> str:
        return self.served_name or self.model or "SmolLM2-135M-Instruct"


@dataclass
class CacheConfig:
    block_size: int = 16
    kv_cache_memory_bytes: int = 2 << 30  # CPU: KV budget; GPU: ignored unless set explicitly
    gpu_memory_utilization: float = 0.90
    num_kv_blocks_override: int | None = None  # tests: force a tiny pool
    enable_prefix_caching: bool = True
    # host memory for swapped-out requests' KV blocks and the host tier of the prefix cache, per
    # worker (pinned on CUDA); 0: no swap space (docs/swap.md)
    swap_space_bytes: int = 0


PREEMPTION_MODES = ("auto", "recompute", "swap")


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 1024  # token budget per step (prefill chunks + decodes)
    max_waiting_requests: int = 4096  # serving admission cap (AsyncEngine); past it new requests are rejected
    policy: str = "fcfs"  # fcfs | priority
    enable_chunked_prefill: bool = True
    # schedule step N+1 while step N runs (placeholders for N's tokens; docs/engine-core.md)
    async_scheduling: bool = False
    # streamed outputs carry this many new tokens each (the first token and the end go at once);
    # larger values trade streaming granularity for front-end CPU (docs/engine-core.md)
    stream_interval: int = 1
    # after an idle spell the engine core (its process, or the inline core's engine thread; both
    # through llmsvc/core/burst.py) takes requests while they keep arriving within
    # this long of each other (or 2% of their step's expected time, if less; 10 gaps at most,
    # until a step's budget is queued) before its first step, so a burst starts as one batch;
    # 0: step at the first request (docs/engine-core.md)
    burst_wait_ms: float = 5.0
    # how a running request gives up its KV blocks under pressure: recompute (drop them, prefill
    # again), swap (copy them to the swap space and back; recompute when it is full), auto: swap
    # when a swap space is configured (docs/swap.md)
    preemption_mode: str = "auto"


@dataclass
class ParallelConfig:
    # a name of executors/registry.py, or an Executor subclass (the offline LLM takes either);
    # tensor_parallel_size > 1 builds the tensor-parallel one whatever name is given (a class is built as is)
    executor: str | type = "uniproc"
    tensor_parallel_size: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 0  # 0 = pick a free port (single node)
    nnodes: int = 1
    node_rank: int = 0


LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")


@dataclass
class LoRAConfig:
    """LoRA adapters served beside the base model: `modules` are loaded at start-up into every
    worker, more may be loaded (and unloaded) while serving, up to max_loras at a time.

    A request names one (GenerateRequest.lora_name); a start-up adapter's id is its position
    here plus 1 (0: the base model). Adapters of every rank up to max_lora_rank may share a step."""
    modules: dict[str, str] = field(default_factory=dict)  # name -> PEFT adapter directory
    max_lora_rank: int = 16
    max_loras: int = 0  # adapter slots in every worker; 0: as many as `modules`, at least 1

    def __post_init__(self) -> None:
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        if self.max_loras == 0:
            self.max_loras = max(1, len(self.modules))
        if self.max_loras < len(self.modules):
            raise ValueError(f"max_loras ({self.max_loras}) must hold the {len(self.modules)} LoRA modules")
        for name, path in self.modules.items():
            if not name or not path:
                raise ValueError(f"a LoRA module needs a name and a path, got {name!r}={path!r}")


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
    max_logprobs: int = 20  # largest `logprobs` / `prompt_logprobs` a request may ask for
    # what sampled-token logprobs report: the model's distribution (raw_logprobs, vLLM's default)
    # or the one sampled from, after penalties, temperature and truncation (processed_logprobs)
    logprobs_mode: str = "raw_logprobs"
    # structured output: a constraint whose grammar takes longer to compile fails (INVALID_ARGUMENT)
    grammar_compile_timeout_s: float = 10.0
    grammar_cache_size: int = 256  # compiled grammars kept, by (kind, spec), least recently used out
    engine_core: str = "inline"  # inline: EngineCore in the caller's process | process: its own, over ZeroMQ
    lora_config: LoRAConfig | None = None  # None: no adapters (requests naming one fail)
    speculative_config: SpeculativeConfig | None = None  # None: one token per decode step

    def replace(self, **kw) -> "EngineConfig":
        return dataclasses.replace(self, **kw)

    @classmethod
    def from_options(cls, **options) -> "EngineConfig":
        """The one way the entry points (LLM, `llmsvc serve`, `llmsvc bench`) build a config: each
        flat option goes to the section that has a field of that name (EngineConfig itself, then
        model, cache, scheduler, parallel). None means "the default"; `kv_cache_memory` takes a
        size ("2GiB", parse_memory). TypeError for a name no section has; ValueError for a
        logprobs_mode that is not one of LOGPROBS_MODES. `lora_modules` ({name: path}) and
        `max_lora_rank` and `max_loras` build the LoRAConfig; `enable_lora` alone builds one with
        no start-up adapters (they are loaded later). `speculative_config` (a dict or its JSON)
        builds the SpeculativeConfig; it excludes async scheduling (ValueError)."""
        config = cls()
        spec = options.pop("speculative_config", None)
        if spec is not None:
            config.speculative_config = SpeculativeConfig.from_dict(spec)
        lora = {k: options.pop(k) for k in ("lora_modules", "max_lora_rank", "max_loras", "enable_lora")
                if k in options}
        if lora.get("lora_modules") or lora.get("enable_lora"):
            config.lora_config = LoRAConfig(dict(lora.get("lora_modules") or {}),
                                            **{k: lora[k] for k in ("max_lora_rank", "max_loras")
                                               if lora.get(k) is not None})
        sections = (config, config.model_config, config.cache_config, config.scheduler_config,
                    config.parallel_config)
        for key, value in options.items():
            if value is None:
                continue
            if key == "kv_cache_memory":
                key, value = "kv_cache_memory_bytes", parse_memory(value)
            elif key == "swap_space":
                key, value = "swap_space_bytes", parse_memory(value)
            section = next((s for s in sections if key in {f.name for f in dataclasses.fields(s)}), None)
            if section is None:
                raise TypeError(f"unknown engine option {key!r}")
            setattr(section, key, value)
        if config.speculative_config is not None and config.scheduler_config.async_scheduling:
            raise ValueError("speculative decoding needs each step's tokens before the next is "
                             "scheduled: it cannot run with async scheduling")
        if config.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, "
                             f"got {config.logprobs_mode!r}")
        _check_sizes(config)
        return config


def _check_sizes(config: EngineConfig) -> None:
    """ValueError for a size that can never work (a zero token budget would leave every
    request waiting forever; a zero block size divides by zero later)."""
    sc, cc, pc, mc = config.scheduler_config, config.cache_config, config.parallel_config, config.model_config
    for name, value, lo in (
            ("max_num_seqs", sc.max_num_seqs, 1), ("max_num_batched_tokens", sc.max_num_batched_tokens, 1),
            ("stream_interval", sc.stream_interval, 1), ("max_waiting_requests", sc.max_waiting_requests, 0),
            ("block_size", cc.block_size, 1), ("kv_cache_memory_bytes", cc.kv_cache_memory_bytes, 1),
            ("tensor_parallel_size", pc.tensor_parallel_size, 1), ("nnodes", pc.nnodes, 1),
            ("node_rank", pc.node_rank, 0), ("seed", mc.seed, 0), ("grammar_cache_size", config.grammar_cache_size, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < lo:
            raise ValueError(f"{name} must be an integer >= {lo}, got {value!r}")
    if mc.max_model_len is not None and (not isinstance(mc.max_model_len, int) or mc.max_model_len < 1):
        raise ValueError(f"max_model_len must be an integer >= 1, got {mc.max_model_len!r}")
    if not 0 <= pc.master_port <= 65535:
        raise ValueError(f"master_port must be in [0, 65535], got {pc.master_port}")
    t = config.grammar_compile_timeout_s
    if not (isinstance(t, (int, float)) and 0 < t < math.inf):
        raise ValueError(f"grammar_compile_timeout_s must be a positive number of seconds, got {t!r}")
    if sc.preemption_mode not in PREEMPTION_MODES:
        raise ValueError(f"preemption_mode must be one of {', '.join(PREEMPTION_MODES)}, got {sc.preemption_mode!r}")
    if cc.swap_space_bytes < 0 or (sc.preemption_mode == "swap" and not cc.swap_space_bytes):
        raise ValueError("preemption_mode swap needs a swap space (--swap-space SIZE, e.g. 4GiB)"
                         if cc.swap_space_bytes >= 0 else f"swap_space must be >= 0, got {cc.swap_space_bytes}")
    if not 0 <= sc.burst_wait_ms < math.inf:
        raise ValueError(f"burst_wait_ms must be >= 0, got {sc.burst_wait_ms!r}")
