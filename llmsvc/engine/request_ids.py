"""Request ids in flight: the one rule for a duplicate, and the serving path's table of them.

A request with n > 1 samples "foo" is n requests "{index}_foo" in the engine core
(output_processor.child_request_id), and a client may also give a request such an id. A new
request is refused (DuplicateRequestError, ALREADY_EXISTS) when its id, or the id of one of its
samples, is held by a request in flight or by one of its samples: two requests with one id in
the engine core would end its process.
"""
from __future__ import annotations

from typing import Callable

from llmsvc.core.errors import DuplicateRequestError
from llmsvc.engine.output_processor import child_request_id


def check_free(request_id: str, n: int, holder: Callable[[str], str | None]) -> None:
    """DuplicateRequestError unless request_id and its samples' ids are free; holder(id) is the
    request in flight that holds id (itself, or as a sample), or None."""
    owner = holder(request_id)
    if owner == request_id:
        raise DuplicateRequestError(request_id)
    if owner is not None:
        raise DuplicateRequestError(request_id, f"is the id of a sample of request {owner!r}, in flight")
    for i in range(n):
        child = child_request_id(request_id, i, n)
        owner = holder(child)
        if owner is not None:
            raise DuplicateRequestError(request_id, f"would give sample {i} the id {child!r}, which "
                                        f"request {owner!r} in flight holds")


class RequestIds:
    """The ids AsyncEngine has in flight (from generate() until the engine confirms the request
    finished or aborted) with their samples' ids; event-loop side, not thread-safe."""

    def __init__(self) -> None:
        self._holder: dict[str, str] = {}  # id (a request's or a sample's) -> the request holding it

    def holder(self, any_id: str) -> str | None:
        """The request in flight that holds any_id (itself, or as a sample), or None."""
        return self._holder.get(any_id)

    def reserve(self, request_id: str, n: int) -> None:
        """Hold request_id and its samples' ids (check_free(request_id, n, self.holder) first)."""
        self._holder[request_id] = request_id
        for i in range(n):
            self._holder[child_request_id(request_id, i, n)] = request_id

    def release(self, request_id: str, n: int) -> None:
        for i in range(n):
            self._holder.pop(child_request_id(request_id, i, n), None)
        self._holder.pop(request_id, None)

    def clear(self) -> None:
        self._holder.clear()
