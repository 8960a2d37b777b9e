"""What crosses the ZeroMQ sockets between the front end and the engine-core process.

Front end -> core (one message per command, sent as soon as the front end has it):
    ("add", Request) | ("abort", [req_id, ...], reason) | ("utility", call_id, method, args) | ("shutdown",)
Core -> front end (one message per loop iteration that did something, never one per token):
    ("ready", ReadyInfo) | ("outputs", CoreOutputBatch) | ("failed", text) | ("dead", error_type, text)

Serialization is pickle protocol 5. A 64-request decode step (one token each) is 4.1 KB pickled
(9.5 KB as msgpack); msgspec is faster (encode 8 us, decode 25 us vs pickle's 41 us and 46 us)
but both are under 0.1% of a step on the CPU, and pickle needs no schema kept in step with
SamplingParams, Request and EngineCoreOutput as they grow fields.
"""
from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Any

from llmsvc.core.core_output import EngineCoreOutput
from llmsvc.outputs import EngineStats

ADD, ABORT, UTILITY, SHUTDOWN = "add", "abort", "utility", "shutdown"
READY, OUTPUTS, FAILED, DEAD = "ready", "outputs", "failed", "dead"
# FAILED carries (kind, text): a configuration that does not fit (the message) or any other error
# (its traceback)
FAILED_CONFIG, FAILED_ERROR = "config", "error"


@dataclass
class ReadyInfo:
    """Sent once the model is loaded, the KV cache sized and the model warmed up."""
    pid: int
    max_len: int
    stats: EngineStats
    device: str  # what EngineConfig.device ("auto" too) resolved to in the core's process


@dataclass
class CoreOutputBatch:
    """One engine-core loop iteration: the step's outputs plus acknowledgements.

    `aborted` lists the req_ids whose abort the core applied before this step: any output for
    them in an earlier batch is stale (the front end drops it), so a req_id can be reused at once.
    """
    outputs: list[EngineCoreOutput]
    executed: bool
    stats: EngineStats
    aborted: list[str] = field(default_factory=list)
    utility: list[tuple[int, Any]] = field(default_factory=list)  # (call_id, result)
    kv_events: list[tuple] = field(default_factory=list)  # the prefix cache's, since the last batch (kv_events.py)


def encode(msg: tuple) -> bytes:
    return pickle.dumps(msg, protocol=5)


def decode(frame) -> tuple:
    return pickle.loads(frame)
