"""The errors AsyncEngine raises to its callers (the servicer maps each to a gRPC status)."""
from __future__ import annotations

from executors.base import ExecutorError


class AsyncEngineError(RuntimeError):
    """Base of the errors AsyncEngine itself raises."""


class EngineDeadError(AsyncEngineError):
    """The engine loop died; nothing can be served by this engine any more (UNAVAILABLE)."""


class EngineStepError(EngineDeadError):
    """A step raised something other than a worker failure (a bug, bad state): the requests in
    flight failed mid-stream (INTERNAL); the engine is dead like for EngineDeadError."""


def is_worker_failure(exc: BaseException) -> bool:
    """Whether exc is an executors.base.ExecutorError: a worker (or the engine-core process) died or failed."""
    return isinstance(exc, ExecutorError)


class EngineStoppedError(AsyncEngineError):
    """The engine is shutting down and takes no new requests (UNAVAILABLE)."""


class OutputBacklogError(AsyncEngineError):
    """The consumer read too slowly; the request was aborted (RESOURCE_EXHAUSTED)."""
