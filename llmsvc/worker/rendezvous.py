"""Joining a multi-node tensor-parallel group: each rank checks that it runs what rank 0 runs.

Every node starts its ranks from its own command line. A different tensor-parallel size there
would hang the rendezvous (ranks that no other rank expects); a different model shape, dtype,
quantization or LoRA setting would join and then fail inside a collective, or compute something
else without a word. So before joining the process group each rank publishes a fingerprint of
what shapes its part of the computation in the group's store: a rank whose fingerprint differs
from rank 0's fails at start-up naming the fields, and posts the difference for rank 0, which
fails with the same words. Rank 0 logs which ranks it is still waiting for.

Same-shaped but different weights pass: telling them apart would mean reading every weight on
every node at start-up.
"""
from __future__ import annotations

import json
import logging
import time
from datetime import timedelta
from urllib.parse import urlparse

from llmsvc.config import EngineConfig

logger = logging.getLogger(__name__)

PREFIX = "llmsvc/fingerprint/"
MISMATCH = "llmsvc/mismatch"
WAIT_LOG_S = 30.0
ADVICE = "start every node with the same model and options"
_SHAPE_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "num_experts", "moe_intermediate_size")


def fingerprint(config: EngineConfig, world_size: int) -> dict:
    """What every rank must agree on (JSON-able)."""
    mc, lc = config.model_config, config.lora_config
    hf = mc.hf_config
    shape = {k: getattr(hf, k, None) for k in _SHAPE_KEYS} if hf is not None else {}
    return {"tensor_parallel_size": world_size, "nnodes": config.parallel_config.nnodes,
            "architecture": mc.architecture, "dtype": mc.dtype, "quantization": mc.quantization,
            "vocab_size": mc.vocab_size, "max_model_len": mc.max_model_len,
            "block_size": config.cache_config.block_size, **{k: v for k, v in shape.items() if v is not None},
            "lora": None if lc is None else {"max_lora_rank": lc.max_lora_rank, "max_loras": lc.max_loras}}


def differences(ref: dict, other: dict, rank: int) -> list[str]:
    return [f"{k}: rank 0 has {ref.get(k)!r}, rank {rank} {other.get(k)!r}"
            for k in sorted(set(ref) | set(other)) if ref.get(k) != other.get(k)]


def join_store(init_method: str, rank: int, world_size: int, config: EngineConfig, timeout_s: float):
    """The group's TCPStore (rank 0 hosts it at `init_method`, tcp://host:port), after the
    fingerprint check; ValueError naming the differences when a rank runs something else."""
    import torch.distributed as dist

    url = urlparse(init_method)
    store = dist.TCPStore(url.hostname, url.port, None, rank == 0, timedelta(seconds=timeout_s),
                          wait_for_workers=False)
    mine = fingerprint(config, world_size)
    store.set(f"{PREFIX}{rank}", json.dumps(mine))
    if rank != 0:
        ref = json.loads(store.get(f"{PREFIX}0"))
        diff = differences(ref, mine, rank)
        if diff:
            store.set(MISMATCH, f"node {config.parallel_config.node_rank}: " + "; ".join(diff))
            raise ValueError(f"this node's configuration differs from node 0's ({ADVICE}): " + "; ".join(diff))
        return store
    waiting, last_log = list(range(1, world_size)), time.monotonic()
    while waiting:
        if store.check([MISMATCH]):
            raise ValueError(f"a rank's configuration differs from node 0's ({ADVICE}): "
                             f"{store.get(MISMATCH).decode()}")
        for r in [r for r in waiting if store.check([f"{PREFIX}{r}"])]:
            diff = differences(mine, json.loads(store.get(f"{PREFIX}{r}")), r)
            if diff:
                raise ValueError(f"rank {r}'s configuration differs from node 0's ({ADVICE}): " + "; ".join(diff))
            waiting.remove(r)
        if waiting:
            if time.monotonic() - last_log >= WAIT_LOG_S:
                logger.info("waiting for ranks %s to join at %s", waiting, init_method)
                last_log = time.monotonic()
            time.sleep(0.05)
    return store
