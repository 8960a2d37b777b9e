"""AsyncEngine's utility calls: engine methods run on the engine thread between two steps.

The mixin keeps no state; it uses AsyncEngine's engine, _dead, _thread, _stop, _loop, _send and
sets _kv_listener.
"""
from __future__ import annotations

from llmsvc.engine.commands import UtilityCall
from llmsvc.engine.errors import EngineDeadError, EngineStoppedError


class EngineCallsMixin:
    async def reset_prefix_cache(self) -> bool:
        """The engine's reset_prefix_cache(), run on the engine thread between two steps: False
        while a request holds KV blocks. EngineDeadError / EngineStoppedError when there is no
        engine to ask."""
        return bool(await self._engine_call("reset_prefix_cache"))

    async def follow_kv_events(self, listener) -> None:
        """From now on call listener(page) on the event loop with the prefix cache's new stored /
        removed / cleared events (llmsvc.core.kv_events.KVEventPage, numbered from 1), after every
        step or utility call that made some and before that step's outputs reach their streams:
        a gateway routing by cache contents has a request's blocks before its client sees it
        finish. Turns the engine's recording on; raises as the engine call does (AttributeError
        for an engine without a journal)."""
        await self._engine_call("take_kv_events", 0)
        self._kv_listener = listener

    async def add_lora(self, name: str, path: str):
        """The engine's add_lora (LoRAEntry; LoRAAdminError), between two steps."""
        return await self._engine_call("add_lora", name, path)

    async def remove_lora(self, name: str) -> None:
        """The engine's remove_lora (LoRANotFoundError, LoRAAdminError), between two steps."""
        await self._engine_call("remove_lora", name)

    def lora_entries(self) -> list:
        """The served LoRA adapters (LoRAEntry), as the engine thread last changed them."""
        registry = getattr(self.engine, "loras", None)
        return registry.entries() if registry is not None else []

    async def _engine_call(self, name: str, *args):
        if self._dead is not None:
            raise EngineDeadError(f"engine loop died: {self._dead}")
        if self._thread is None or self._stop:
            raise EngineStoppedError("engine stopped")
        fut = self._loop.create_future()
        self._send(UtilityCall(name, args, fut))
        return await fut
