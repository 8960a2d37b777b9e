"""LLMEngine: the synchronous engine both front ends drive (offline LLM, the async server engine).

add_request builds an EngineRequest (vLLM's spelling, for offline callers), admit() validates one
(once: llmsvc.engine.admission), add_admitted() queues it; step() takes the engine core's next outputs (token ids) and
turns them into RequestOutputs. The engine core sits behind an EngineCoreClient: in this process
(config.engine_core "inline") or in its own (“process”), where it computes the next step while
this one detokenizes. Not thread-safe: call it from one thread (the async engine's loop thread).
"""
from __future__ import annotations

import functools
import logging
import time
from collections.abc import Iterable

from executors.base import Executor
from llmsvc.config import EngineConfig
from llmsvc.core.client import EngineCoreClient, InprocClient
from llmsvc.core.engine_core import EngineCore
from llmsvc.core.errors import LoRAAdminError
from llmsvc.engine.output_processor import OutputProcessor, ParentRequest
from llmsvc.core.request import Request
from llmsvc.engine.stats import StatsLogger
from llmsvc.engine.lora_registry import LoRAEntry, LoRARegistry
from llmsvc.engine.admission import AdmittedRequest, Admission
from llmsvc.engine.request_ids import check_free
from llmsvc.engine.validation import RequestLimits
from llmsvc.engine_request import EngineRequest
from llmsvc.outputs import ABORT, STOP, EngineStats, RequestOutput
from llmsvc.sampling_params import SamplingParams
from llmsvc.structured.build import build_structured_output_manager, model_eos_token_ids, model_vocab_size

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig, core: EngineCoreClient | Executor, tokenizer) -> None:
        """`core`: an EngineCoreClient, or an Executor to drive from an in-process EngineCore."""
        self.config = config
        self.tokenizer = tokenizer
        mc = config.model_config
        self.vocab_size = model_vocab_size(config, tokenizer)
        self.eos_token_ids = model_eos_token_ids(config, tokenizer)
        # compiles constraints for validation and compile errors (AsyncEngine, LLM); inline it is
        # also the core's, so each constraint compiles once; a core process builds its own
        self.structured_output_manager = build_structured_output_manager(config, tokenizer)
        if isinstance(core, EngineCoreClient):
            self.core_client = core  # the manager builds its tokenizer view on the first constraint
        else:
            if self.structured_output_manager is not None:  # builds while the KV cache is set up
                self.structured_output_manager.prewarm()
            self.core_client = InprocClient(EngineCore(config, core, self.structured_output_manager))
        self.output_processor = OutputProcessor(tokenizer, config.scheduler_config.stream_interval)
        self.stats_logger = StatsLogger(config.log_stats_interval_s)
        self.loras = LoRARegistry(config.lora_config)
        self.admission = Admission(self.request_limits, tokenizer=tokenizer, loras=self.loras,
                                   structured=self.structured_output_manager is not None, seed=mc.seed)
        self._shutdown = False

    @classmethod
    def from_config(cls, config: EngineConfig, core_client=None) -> "LLMEngine":
        """Resolve the model, start the engine core (executor, KV cache sizing, warm-up), load the
        tokenizer. With engine_core "process" the tokenizer loads while the core loads the model;
        `core_client`: an MPClient already started by start_engine_core(config), which also
        returned the resolved `config` to pass here."""
        if core_client is None:
            if config.engine_core == "process":
                config, core_client = start_engine_core(config)
            else:
                config = _resolved(config)
        if config.engine_core == "process":
            client = core_client
            try:
                tokenizer = _load_tokenizer(config)
                client.wait_ready()
                # the device "auto" became in the core, for GetServerInfo and the logs
                return cls(config.replace(device=client.device), client, tokenizer)
            except BaseException:
                client.shutdown()
                raise
        from executors import create_executor  # lazy: executors may pull in torch

        tokenizer = _load_tokenizer(config)
        executor = create_executor(config)
        try:
            return cls(config, executor, tokenizer)
        except BaseException:
            executor.shutdown()
            raise

    @property
    def core(self):
        """The EngineCore itself when it runs in this process (introspection, tests)."""
        return self.core_client.core

    def wake(self) -> None:
        """Thread-safe: make a step() blocked on the engine-core process return early."""
        self.core_client.wake()

    # vLLM's names, which scripts reach through LLM.llm_engine
    @property
    def model_config(self):
        return self.config.model_config

    def get_tokenizer(self):
        return self.tokenizer

    # ---- requests --------------------------------------------------------------------------
    @property
    def max_model_len(self) -> int:
        return self.core_client.max_len

    @functools.cached_property
    def request_limits(self) -> RequestLimits:
        """The one set of limits requests are admitted against (fixed once the engine is built;
        the doors read these too, through ModelLimits)."""
        max_len, context = self.max_model_len, self.config.model_config.max_model_len
        pool_bound = context is not None and max_len < context
        return RequestLimits(vocab_size=self.vocab_size, max_len=max_len, max_n=self.config.max_n,
                             max_stop_strings=self.config.max_stop_strings, max_logprobs=self.config.max_logprobs,
                             max_len_source="the KV cache pool" if pool_bound else "the maximum context length",
                             eos_token_ids=tuple(self.eos_token_ids))

    def admit(self, request: EngineRequest) -> AdmittedRequest:
        """Validate a request once, at admission (llmsvc.engine.admission); thread-safe enough
        for AsyncEngine to call on its event loop while this engine steps on its thread."""
        return self.admission.admit(request)

    def _holder(self, any_id: str) -> str | None:
        """The request in flight holding any_id (itself, or as a sample), or None."""
        if any_id in self.output_processor:
            return any_id
        taken = self.output_processor.child_to_parent  # every id the engine core holds -> (request, sample)
        return taken[any_id][0].request_id if any_id in taken else None

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                    prompt: str | None = None, priority: int = 0, arrival_time: float | None = None,
                    cache_salt: str | None = None, lora_name: str | None = None) -> None:
        """vLLM's spelling for offline callers: builds the EngineRequest, admits and queues it."""
        request = EngineRequest(request_id, prompt_token_ids, params, prompt=prompt, priority=priority,
                                cache_salt=cache_salt, lora_name=lora_name,
                                arrival_time=time.time() if arrival_time is None else arrival_time)
        admitted = self.admit(request)
        check_free(request.request_id, admitted.request.sampling_params.n, self._holder)
        self.add_admitted(admitted)

    def add_admitted(self, admitted: AdmittedRequest) -> None:
        """Queue a request that passed admit() and whose ids are free (check_free: add_request
        checks offline, AsyncEngine on the serving path): fan it out into its samples in the
        engine core."""
        req = admitted.request
        parent = ParentRequest(req.request_id, req.prompt, req.prompt_token_ids, req.sampling_params,
                               self.tokenizer, req.arrival_time, self.output_processor.stream_interval)
        added: list[str] = []
        try:
            for child in parent.children:
                self.core_client.add_request(Request(child.req_id, req.prompt_token_ids, child.params,
                                                     eos_token_ids=self.eos_token_ids,
                                                     arrival_time=req.arrival_time, priority=req.priority,
                                                     cache_salt=req.cache_salt, lora_key=admitted.lora_key,
                                                     lora_id=admitted.lora_id))
                added.append(child.req_id)
        except BaseException:
            self.core_client.abort_requests(added)
            raise
        self.output_processor.add_request(parent)

    def abort_request(self, request_ids: Iterable[str] | str) -> None:
        """Abort user requests (unknown ids ignored); each gets a final "abort" output next step()."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        self.core_client.abort_requests(self.output_processor.abort(list(request_ids), ABORT), ABORT)

    # ---- stepping --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        core_outputs, _ = self.core_client.get_output()
        outputs, stop_finished = self.output_processor.process_outputs(core_outputs)
        if stop_finished:
            self.core_client.abort_requests(stop_finished, STOP)
        self.log_stats()
        return outputs

    def log_stats(self) -> None:
        """The periodic throughput line, when its interval has passed (step() and the serving
        engine thread's idle tick call this)."""
        if self.config.log_stats_interval_s > 0:
            self.stats_logger.maybe_log(self.core_client.get_stats())

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished() or self.core_client.has_unfinished()

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.get_num_unfinished()

    def add_lora(self, name: str, path: str) -> LoRAEntry:
        """Load a LoRA adapter into a free slot of every worker; requests may name it from then on.
        Raises LoRAAdminError (off, name taken, no free slot, the adapter would not load)."""
        entry = self.loras.reserve(name, path)
        error = self.core_client.call_utility("add_lora", entry.lora_id, name, path)
        if error:
            raise LoRAAdminError("LORA_LOAD_FAILED", error)
        self.loras.commit(entry)
        logger.info("LoRA adapter %s loaded from %s into slot %d", name, path, entry.lora_id - 1)
        return entry

    def remove_lora(self, name: str) -> None:
        """Unload an adapter. LoRANotFoundError for an unknown name; LoRAAdminError while requests
        in flight use it (requests that reach the engine afterwards get NOT_FOUND)."""
        entry = self.loras.lookup(name)
        error = self.core_client.call_utility("remove_lora", entry.lora_id)
        if error:
            raise LoRAAdminError("LORA_IN_USE", f"LoRA adapter {name!r}: {error}; unload it when they finished")
        self.loras.remove(name)
        logger.info("LoRA adapter %s unloaded", name)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block hash; only possible while no request holds blocks."""
        return self.core_client.reset_prefix_cache()

    def take_kv_events(self, after_seq: int):
        """The prefix cache's events after `after_seq` (llmsvc.core.kv_events.KVEventPage); the
        first call turns their recording on in the engine core."""
        return self.core_client.take_kv_events(after_seq)

    def get_stats(self) -> EngineStats:
        return self.core_client.get_stats()

    def check_health(self) -> None:
        """Raise executors.base.ExecutorError if a worker is dead (cheap; called when idle)."""
        self.core_client.check_health()

    def shutdown(self) -> None:
        if not self._shutdown:
            self._shutdown = True
            self.core_client.shutdown()


def _resolved(config: EngineConfig) -> EngineConfig:
    """The model resolved; inline also the device "auto" stands for (a core process resolves
    its own, keeping torch out of this process)."""
    from llmsvc.models.resolve import resolve_model_config
    from llmsvc.models.tp_split import check_tensor_parallel

    if config.engine_core not in ("inline", "process"):
        raise ValueError(f"engine_core must be 'inline' or 'process', got {config.engine_core!r}")
    config = config.replace(model_config=resolve_model_config(config.model_config, config.device))
    check_tensor_parallel(config.model_config.hf_config, config.parallel_config.tensor_parallel_size)
    if config.engine_core == "inline":
        from llmsvc.worker.device import resolve_device_type

        config = config.replace(device=resolve_device_type(config.device))
    return config


def start_engine_core(config: EngineConfig) -> tuple[EngineConfig, EngineCoreClient]:
    """Spawn the engine-core process, then resolve the model here while the core resolves and
    loads it there (resolving is deterministic, and a GGUF conversion is locked and atomic).
    Returns the resolved config and the client to hand to LLMEngine.from_config."""
    from llmsvc.core.mp_client import MPClient

    client = MPClient(config)
    try:
        return _resolved(config), client
    except BaseException:
        client.shutdown()
        raise


def _load_tokenizer(config: EngineConfig):
    from llmsvc.models.cache_files import derived_cache_dir
    from llmsvc.models.tokenizer import load_tokenizer

    return load_tokenizer(config.model_config.tokenizer_dir, derived_cache_dir(), config.model_config.chat_template)
