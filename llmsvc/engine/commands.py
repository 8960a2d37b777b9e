"""What the event loop asks of AsyncEngine's engine thread: typed commands, applied in order.

Each command that has an answer carries the asyncio future the engine thread settles (through
the loop's call_soon_threadsafe): None or a result when it succeeded, the exception when not.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from llmsvc.engine.admission import AdmittedRequest


@dataclass
class AddRequest:
    """Queue an admitted request (LLMEngine.add_admitted); the future settles once it is queued."""

    admitted: AdmittedRequest
    future: asyncio.Future


@dataclass
class AbortRequests:
    """Abort these requests (LLMEngine.abort_request); unknown ids are ignored."""

    request_ids: list[str]


@dataclass
class UtilityCall:
    """engine.<method>(*args) between two steps (prefix-cache reset, LoRA admin)."""

    method: str
    args: tuple = field(default_factory=tuple)
    future: asyncio.Future | None = None


Command = AddRequest | AbortRequests | UtilityCall
