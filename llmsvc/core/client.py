"""EngineCoreClient: how the front end (LLMEngine) reaches the engine core, wherever it runs.

The engine core is the Scheduler + KVCacheManager + Executor driven by `EngineCore.step()`.
It sees only tokenized child requests (n == 1) and reports token ids; text, stop strings,
logprob formatting and n > 1 fan-out stay in the front end (OutputProcessor).

Two implementations, chosen by EngineConfig.engine_core:
- InprocClient ("inline"): the EngineCore lives in the caller's process; get_output() runs one
  step. What `LLM` and unit tests use.
- MPClient ("process", llmsvc.core.mp_client): the EngineCore runs a busy loop in its own process
  behind ZeroMQ; get_output() returns whatever steps finished since the last call.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

from llmsvc.core.core_output import EngineCoreOutput
from llmsvc.core.engine_core import EngineCore
from llmsvc.core.kv_events import KVEventPage
from llmsvc.core.request import Request
from llmsvc.outputs import ABORT, EngineStats


class EngineCoreClient(ABC):
    """Owned by one LLMEngine and called from one thread at a time.

    Promises: every request added is eventually reported finished by exactly one output with a
    finish_reason, unless the front end aborted it first (then nothing more is reported for it).
    A dead engine core (its process or a worker died) raises executors.base.ExecutorError from
    get_output() / check_health()."""

    @property
    @abstractmethod
    def max_len(self) -> int:
        """Most tokens (prompt + output) one request can hold: context and KV pool permitting."""

    @abstractmethod
    def add_request(self, request: Request) -> None:
        """Queue a tokenized child request. Inline, a refusal raises PromptTooLongError /
        QueueFullError; across processes it comes back as a finished "abort" output."""

    @abstractmethod
    def abort_requests(self, req_ids: list[str], reason: str = ABORT) -> None:
        """Finish these requests in the core (blocks freed); unknown ids are ignored."""

    @abstractmethod
    def get_output(self) -> tuple[list[EngineCoreOutput], bool]:
        """The outputs of the next step(s), and whether the model ran. Inline this runs one step;
        across processes it waits for the core (or a wake()) while requests are outstanding."""

    @abstractmethod
    def has_unfinished(self) -> bool:
        """Requests added and neither reported finished nor aborted."""

    @abstractmethod
    def get_stats(self) -> EngineStats:
        """Scheduler and KV cache counters (as of the core's last step)."""

    @abstractmethod
    def reset_prefix_cache(self) -> bool:
        """Forget every cached block hash; only possible while no request holds blocks."""

    @abstractmethod
    def call_utility(self, method: str, *args):
        """EngineCore.<method>(*args) between two steps (add_lora, remove_lora); its result."""

    def take_kv_events(self, after_seq: int) -> KVEventPage:
        """The prefix cache's events numbered after `after_seq` (llmsvc.core.kv_events); the first
        call turns their recording on in the core."""
        return self.call_utility("take_kv_events", after_seq)

    @abstractmethod
    def check_health(self) -> None:
        """Raise executors.base.ExecutorError if the core or one of its workers is dead."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop the core and its executor. Idempotent."""

    def wake(self) -> None:
        """Make a get_output() blocked in another thread return early (new commands to send).
        Thread-safe; a no-op where get_output() never blocks."""


class InprocClient(EngineCoreClient):
    """The EngineCore in this process; each get_output() is one EngineCore.step()."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core

    @property
    def max_len(self) -> int:
        return self.core.max_len

    def add_request(self, request: Request) -> None:
        self.core.add_request(request)

    def abort_requests(self, req_ids: list[str], reason: str = ABORT) -> None:
        self.core.abort_requests(req_ids, reason)

    def get_output(self) -> tuple[list[EngineCoreOutput], bool]:
        return self.core.step()

    def has_unfinished(self) -> bool:
        return self.core.has_unfinished()

    def get_stats(self) -> EngineStats:
        return self.core.stats

    def reset_prefix_cache(self) -> bool:
        return self.core.kv_cache_manager.pool.reset_prefix_cache()

    def call_utility(self, method: str, *args):
        return getattr(self.core, method)(*args)

    def check_health(self) -> None:
        self.core.executor.check_health()

    def shutdown(self) -> None:
        self.core.shutdown()
