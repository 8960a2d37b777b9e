"""LazyStructuredOutputManager: a grammar manager built on the first constrained request.

The engine-core process needs a grammar manager only for constrained requests, yet building one
loads the tokenizer and llguidance's token table (~0.2 s of start-up). This stands in for it
with the part of the StructuredOutputManager interface EngineCore uses, and builds the real one
the first time a request needs it. Built in the core's own thread (add_request), so no lock.
"""
from __future__ import annotations

from typing import Callable


class LazyStructuredOutputManager:
    """Promises: `new_request` / `fill_bitmask` behave as the built manager's; `shutdown` stops it
    if it was ever built. `build` must return a manager (it is only called once one is needed:
    the front end refuses constrained requests when it has no manager of its own)."""

    def __init__(self, build: Callable[[], object]) -> None:
        self._build = build
        self._manager = None

    @property
    def built(self) -> bool:
        return self._manager is not None

    def _get(self):
        if self._manager is None:
            manager = self._build()
            if manager is None:
                raise RuntimeError("structured output is not available in the engine core")
            self._manager = manager
        return self._manager

    def new_request(self, params):
        return self._get().new_request(params)

    def fill_bitmask(self, requests):
        return self._get().fill_bitmask(requests)

    def shutdown(self) -> None:
        if self._manager is not None:
            self._manager.shutdown()
