"""LLMEngine: the synchronous engine both front ends drive (offline LLM, the async server engine).

add_request validates and queues; step() takes the engine core's next outputs (token ids) and
turns them into RequestOutputs. The engine core sits behind an EngineCoreClient: in this process
(config.engine_core "inline") or in its own (“process”), where it computes the next step while
this one detokenizes. Not thread-safe: call it from one thread (the async engine's loop thread).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from executors.base import Executor
from llmsvc.config import EngineConfig
from llmsvc.core.client import EngineCoreClient, InprocClient
from llmsvc.engine.engine_core import EngineCore
from llmsvc.engine.errors import DuplicateRequestError, InvalidRequestError, PromptTooLongError
from llmsvc.engine.output_processor import OutputProcessor, ParentRequest
from llmsvc.engine.request import Request
from llmsvc.engine.stats import StatsLogger
from llmsvc.outputs import ABORT, STOP, EngineStats, RequestOutput
from llmsvc.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig, core: EngineCoreClient | Executor, tokenizer) -> None:
        """`core`: an EngineCoreClient, or an Executor to drive from an in-process EngineCore."""
        self.config = config
        self.tokenizer = tokenizer
        self.core_client = core if isinstance(core, EngineCoreClient) else InprocClient(EngineCore(config, core))
        self.output_processor = OutputProcessor(tokenizer)
        self.stats_logger = StatsLogger(config.log_stats_interval_s)
        mc = config.model_config
        self.vocab_size = mc.vocab_size or (len(tokenizer) if tokenizer is not None else 0)
        self.eos_token_ids = list(mc.eos_token_ids)
        if not self.eos_token_ids and getattr(tokenizer, "eos_token_id", None) is not None:
            self.eos_token_ids = [tokenizer.eos_token_id]
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
                return cls(config, client, tokenizer)
            except BaseException:
                client.shutdown()
                raise
        client = InprocClient.from_config(config)
        try:
            return cls(config, client, _load_tokenizer(config))
        except BaseException:
            client.shutdown()
            raise

    @property
    def core(self):
        """The EngineCore itself when it runs in this process (introspection, tests)."""
        return self.core_client.core

    def wake(self) -> None:
        """Thread-safe: make a step() blocked on the engine-core process return early."""
        self.core_client.wake()

    # ---- requests --------------------------------------------------------------------------
    @property
    def max_model_len(self) -> int:
        return self.core_client.max_len

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise InvalidRequestError / PromptTooLongError for a request this engine cannot serve."""
        try:
            params.verify()
        except ValueError as e:
            raise InvalidRequestError(str(e).split(" ", 1)[0], str(e)) from None
        n_prompt = len(prompt_token_ids)
        if n_prompt == 0:
            raise InvalidRequestError("prompt", "must not be empty")
        vocab = self.vocab_size
        if vocab:
            bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
            if bad:
                raise InvalidRequestError("prompt_token_ids", f"token id {bad[0]} is out of range [0, {vocab})")
            bad = [t for t in params.stop_token_ids if t >= vocab]
            if bad:
                raise InvalidRequestError("stop_token_ids", f"token id {bad[0]} is out of range [0, {vocab})")
            bad = [t for t in (params.logit_bias or {}) if t >= vocab]
            if bad:
                raise InvalidRequestError("logit_bias", f"token id {bad[0]} is out of range [0, {vocab})")
        limit = self.max_model_len
        if n_prompt >= limit:
            raise PromptTooLongError(n_prompt, limit)
        if params.max_tokens is not None and n_prompt + params.max_tokens > limit:
            raise InvalidRequestError(
                "max_tokens", f"prompt ({n_prompt} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                f"maximum context length {limit}; lower max_tokens to at most {limit - n_prompt}")
        if n_prompt + params.min_tokens >= limit:
            raise InvalidRequestError(
                "min_tokens", f"prompt ({n_prompt} tokens) + min_tokens ({params.min_tokens}) must be below "
                f"the maximum context length {limit}")
        if len(params.stop) > self.config.max_stop_strings:
            raise InvalidRequestError("stop", f"{len(params.stop)} stop strings; at most "
                                      f"{self.config.max_stop_strings} allowed")
        if params.n > self.config.max_n:
            raise InvalidRequestError("n", f"must be <= {self.config.max_n}, got {params.n}")

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                    prompt: str | None = None, priority: int = 0, arrival_time: float | None = None) -> None:
        if request_id in self.output_processor:
            raise DuplicateRequestError(request_id)
        prompt_token_ids = list(prompt_token_ids)
        self.validate(prompt_token_ids, params)
        arrival_time = time.time() if arrival_time is None else arrival_time
        parent = ParentRequest(request_id, prompt, prompt_token_ids, params, self.tokenizer, arrival_time)
        added: list[str] = []
        try:
            for child in parent.children:
                self.core_client.add_request(Request(child.req_id, prompt_token_ids, child.params,
                                              eos_token_ids=self.eos_token_ids, arrival_time=arrival_time,
                                              priority=priority))
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
        if self.config.log_stats_interval_s > 0:
            self.stats_logger.maybe_log(self.core_client.get_stats())
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished() or self.core_client.has_unfinished()

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.get_num_unfinished()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block hash; only possible while no request holds blocks."""
        return self.core_client.reset_prefix_cache()

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
    from llmsvc.models.resolve import resolve_model_config

    if config.engine_core not in ("inline", "process"):
        raise ValueError(f"engine_core must be 'inline' or 'process', got {config.engine_core!r}")
    return config.replace(model_config=resolve_model_config(config.model_config))


def start_engine_core(config: EngineConfig) -> tuple[EngineConfig, EngineCoreClient]:
    """Resolve the model and spawn the engine-core process; returns at once (the core loads the
    model while the caller goes on). Returns the resolved config and the client to hand to
    LLMEngine.from_config."""
    from llmsvc.core.mp_client import MPClient

    config = _resolved(config)
    return config, MPClient(config)


def _load_tokenizer(config: EngineConfig):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(config.model_config.model_dir)
