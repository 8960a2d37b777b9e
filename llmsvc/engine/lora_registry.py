"""The LoRA adapters an engine serves, by name: their ids (worker slot + 1) and cache keys.

Owned by LLMEngine and changed only on its thread (start-up adapters, then loads and unloads);
other threads (the gRPC servicer's early name check) only read it. An adapter's cache key is its
name and load number: an adapter unloaded and loaded again under the same name (new weights,
perhaps) never hits the prefix-cache blocks of the earlier one.
"""
from __future__ import annotations

import itertools
import json
import os
from dataclasses import dataclass

from llmsvc.core.errors import InvalidRequestError, LoRAAdminError, LoRANotFoundError

MAX_NAME_CHARS = 256  # an adapter loaded while serving


@dataclass(frozen=True)
class LoRAEntry:
    name: str
    path: str
    lora_id: int  # 1-based; the workers' slot lora_id - 1
    key: str  # what the prefix cache hashes: name and load number
    rank: int = 0  # r of its adapter_config.json (0 if unreadable)


def adapter_rank(path: str) -> int:
    try:
        with open(os.path.join(path, "adapter_config.json")) as f:
            return int(json.load(f).get("r", 0))
    except (OSError, ValueError, TypeError, AttributeError):
        return 0


class LoRARegistry:
    def __init__(self, lora_config) -> None:
        self.config = lora_config
        self._loads = itertools.count()
        self._entries: dict[str, LoRAEntry] = {}
        for i, (name, path) in enumerate((lora_config.modules if lora_config else {}).items(), 1):
            self._entries[name] = self._new_entry(name, path, i)

    def entries(self) -> list[LoRAEntry]:
        return sorted(list(self._entries.values()), key=lambda e: e.lora_id)  # list(): one atomic copy

    def lookup(self, name: str | None) -> LoRAEntry | None:
        """The adapter a request names (None: the base model). LoRANotFoundError if none is."""
        if name is None:
            return None
        if not isinstance(name, str) or not name:
            raise InvalidRequestError("lora_name", "must be a non-empty string when set")
        entry = self._entries.get(name)
        if entry is None:
            raise LoRANotFoundError(name, list(self._entries))
        return entry

    def reserve(self, name: str, path: str) -> LoRAEntry:
        """A new entry for an adapter about to load (not yet served: `commit` it once loaded)."""
        if self.config is None:
            raise LoRAAdminError("LORA_DISABLED", "LoRA is off: start the server with --enable-lora (and "
                                 "--max-loras for the adapters to hold at once), or LLM(enable_lora=True)")
        if not name or not path:
            raise InvalidRequestError("lora_name" if not name else "lora_path", "must not be empty")
        if len(name) > MAX_NAME_CHARS or not name.isprintable():  # it goes into logs, metrics and messages
            raise InvalidRequestError("lora_name", f"must be at most {MAX_NAME_CHARS} printable characters")
        if name in self._entries:
            raise LoRAAdminError("LORA_EXISTS", f"a LoRA adapter named {name!r} is loaded already "
                                 f"(from {self._entries[name].path}); unload it first")
        used = {e.lora_id for e in self._entries.values()}
        free = next((i for i in range(1, self.config.max_loras + 1) if i not in used), None)
        if free is None:
            raise LoRAAdminError("LORA_SLOTS_FULL", f"all {self.config.max_loras} LoRA slots are in use "
                                 f"({', '.join(self._entries)}); unload one or raise --max-loras")
        return self._new_entry(name, path, free)

    def _new_entry(self, name: str, path: str, lora_id: int) -> LoRAEntry:
        return LoRAEntry(name, path, lora_id, f"{name}\0{next(self._loads)}", adapter_rank(path))

    def commit(self, entry: LoRAEntry) -> None:
        self._entries[entry.name] = entry

    def remove(self, name: str) -> LoRAEntry:
        entry = self.lookup(name)
        del self._entries[name]
        return entry
