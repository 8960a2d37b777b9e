"""LLMEngine: the synchronous engine both front ends drive (offline LLM, the async server engine).

add_request validates and queues; step() runs one EngineCore step and turns its token ids into
RequestOutputs. Not thread-safe: call it from one thread (the async engine's loop thread).
"""
from __future__ import annotations

import dataclasses
import logging
import random
import time
from collections.abc import Iterable

from executors.base import Executor
from llmsvc.config import EngineConfig
from llmsvc.engine.engine_core import EngineCore
from llmsvc.engine.errors import DuplicateRequestError, InvalidRequestError
from llmsvc.engine.output_processor import OutputProcessor, ParentRequest
from llmsvc.engine.request import Request
from llmsvc.engine.stats import StatsLogger
from llmsvc.engine.validation import RequestLimits, check_request
from llmsvc.outputs import ABORT, STOP, EngineStats, RequestOutput
from llmsvc.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig, executor: Executor, tokenizer) -> None:
        self.config = config
        self.tokenizer = tokenizer
        mc = config.model_config
        self.vocab_size = mc.vocab_size or (len(tokenizer) if tokenizer is not None else 0)
        # seeds for unseeded sampling requests: drawn at admission so each one is echoed and can be
        # replayed; the stream follows the configured seed, so a rerun of the same requests repeats.
        # 62 bits: seed + index stays below the 2^63 a request may ask for
        self._seed_rng = random.Random(mc.seed)
        self.eos_token_ids = list(mc.eos_token_ids)
        if not self.eos_token_ids and getattr(tokenizer, "eos_token_id", None) is not None:
            self.eos_token_ids = [tokenizer.eos_token_id]
        self.structured_output_manager = _structured_output_manager(config, tokenizer, self.vocab_size,
                                                                    self.eos_token_ids)
        self.core = EngineCore(config, executor, self.structured_output_manager)
        self.output_processor = OutputProcessor(tokenizer)
        self.stats_logger = StatsLogger(config.log_stats_interval_s)
        self._shutdown = False

    @classmethod
    def from_config(cls, config: EngineConfig) -> "LLMEngine":
        """Resolve the model, load its tokenizer, start the executor, size the KV cache."""
        from executors import create_executor  # lazy: executors may pull in torch
        from llmsvc.models.resolve import resolve_model_config
        from llmsvc.worker.device import resolve_device_type
        from transformers import AutoTokenizer

        # every layer (workers, GetServerInfo) sees the device "auto" resolved to
        config = config.replace(model_config=resolve_model_config(config.model_config),
                                device=resolve_device_type(config.device))
        tokenizer = AutoTokenizer.from_pretrained(config.model_config.model_dir)
        executor = create_executor(config)
        try:
            return cls(config, executor, tokenizer)
        except BaseException:
            executor.shutdown()
            raise

    # ---- requests --------------------------------------------------------------------------
    @property
    def max_model_len(self) -> int:
        return self.core.max_len

    @property
    def request_limits(self) -> RequestLimits:
        max_len, context = self.max_model_len, self.config.model_config.max_model_len
        pool_bound = context is not None and max_len < context
        return RequestLimits(vocab_size=self.vocab_size, max_len=max_len, max_n=self.config.max_n,
                             max_stop_strings=self.config.max_stop_strings,
                             max_len_source="the KV cache pool" if pool_bound else "the maximum context length")

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise InvalidRequestError / PromptTooLongError for a request this engine cannot serve."""
        check_request(prompt_token_ids, params, self.request_limits)
        if params.structured_outputs is not None and self.structured_output_manager is None:
            raise InvalidRequestError("structured_outputs", "structured output needs the llguidance package "
                                      "and a fast (Rust) tokenizer; this engine has none")

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                    prompt: str | None = None, priority: int = 0, arrival_time: float | None = None) -> None:
        if request_id in self.output_processor:
            raise DuplicateRequestError(request_id)
        prompt_token_ids = list(prompt_token_ids)
        self.validate(prompt_token_ids, params)
        arrival_time = time.time() if arrival_time is None else arrival_time
        if params.seed is None and not params.greedy:
            params = dataclasses.replace(params, seed=self._seed_rng.getrandbits(62))
        parent = ParentRequest(request_id, prompt, prompt_token_ids, params, self.tokenizer, arrival_time)
        added: list[str] = []
        try:
            for child in parent.children:
                req = Request(child.req_id, prompt_token_ids, child.params, eos_token_ids=self.eos_token_ids,
                              arrival_time=arrival_time, priority=priority)
                if params.structured_outputs is not None:  # one grammar state per sample (n > 1)
                    req.structured = self.structured_output_manager.new_request(params.structured_outputs)
                self.core.add_request(req)
                added.append(child.req_id)
        except BaseException:
            self.core.abort_requests(added)
            raise
        self.output_processor.add_request(parent)

    def abort_request(self, request_ids: Iterable[str] | str) -> None:
        """Abort user requests (unknown ids ignored); each gets a final "abort" output next step()."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        self.core.abort_requests(self.output_processor.abort(list(request_ids), ABORT), ABORT)

    # ---- stepping --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        core_outputs, _ = self.core.step()
        outputs, stop_finished = self.output_processor.process_outputs(core_outputs)
        if stop_finished:
            self.core.abort_requests(stop_finished, STOP)
        if self.config.log_stats_interval_s > 0:
            self.stats_logger.maybe_log(self.core.stats)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished() or self.core.has_unfinished()

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.get_num_unfinished()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block hash; only possible while no request holds blocks."""
        return self.core.kv_cache_manager.pool.reset_prefix_cache()

    def get_stats(self) -> EngineStats:
        return self.core.stats

    def check_health(self) -> None:
        """Raise executors.base.ExecutorError if a worker is dead (cheap; called when idle)."""
        self.core.executor.check_health()

    def shutdown(self) -> None:
        if not self._shutdown:
            self._shutdown = True
            self.core.shutdown()


def _structured_output_manager(config: EngineConfig, tokenizer, vocab_size: int, eos_token_ids: list[int]):
    """The grammar manager, or None where llguidance or a fast tokenizer is missing (then every
    constrained request is refused at validation)."""
    from llmsvc import structured

    if tokenizer is None or not getattr(tokenizer, "is_fast", False) or not structured.available():
        return None
    from llmsvc.structured.manager import StructuredOutputManager

    return StructuredOutputManager(tokenizer, vocab_size, eos_token_ids,
                                   compile_timeout_s=config.grammar_compile_timeout_s,
                                   cache_size=config.grammar_cache_size)
