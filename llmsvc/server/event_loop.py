"""Which asyncio event loop runs the server: uvloop where installed, else asyncio's own.

grpc.aio runs on any asyncio loop. Streaming one message per token keeps the loop busy with
futures, callbacks and wake-ups, and uvloop (libuv underneath, the loop vLLM's servers use
too) does that work with less CPU: on the 2-core box the event loop's CPU per output token
fell by ~10% (docs/engine-core.md, "Event loop"). `--event-loop asyncio` keeps the standard
loop; `uvloop` insists on it (exit 2 where it is not installed).
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, Coroutine

CHOICES = ("auto", "uvloop", "asyncio")
logger = logging.getLogger("llmsvc.server")


def resolve(choice: str) -> str:
    """"uvloop" or "asyncio" for a --event-loop value; ValueError for uvloop when not installed."""
    if choice not in CHOICES:
        raise ValueError(f"--event-loop must be one of {', '.join(CHOICES)}, not {choice!r}")
    if choice == "asyncio":
        return "asyncio"
    try:
        import uvloop  # noqa: F401
    except ImportError:
        if choice == "uvloop":
            raise ValueError("--event-loop uvloop: uvloop is not installed (pip install uvloop)") from None
        return "asyncio"
    return "uvloop"


def run(main: Coroutine[Any, Any, Any], loop: str) -> Any:
    """asyncio.run(main) on the resolved loop ("uvloop" or "asyncio")."""
    if loop == "uvloop":
        import uvloop
        logger.info("event loop: uvloop %s", uvloop.__version__)
        return uvloop.run(main)
    logger.info("event loop: asyncio")
    return asyncio.run(main)
