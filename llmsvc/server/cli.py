"""`llmsvc serve [MODEL]`: start the gRPC server. Every flag can also come from LLMSVC_<FLAG>.

Logs "listening on HOST:PORT" once bound and "ready" once the model is loaded and warmed up.
SIGTERM/SIGINT drain gracefully (NOT_SERVING, new requests UNAVAILABLE, in-flight requests
get --shutdown-grace seconds). Exit code 1 when the engine died, so an orchestrator restarts it.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import re
import signal

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000 ** 2, "mb": 1000 ** 2, "mib": 1024 ** 2,
          "g": 1000 ** 3, "gb": 1000 ** 3, "gib": 1024 ** 3, "t": 1000 ** 4, "tb": 1000 ** 4, "tib": 1024 ** 4}


def parse_bytes(text: str) -> int:
    """'2GiB' -> 2147483648; '512MB' -> 512000000; '1024' -> 1024."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 2GiB, 512MiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _env(name: str, default, type_=str):
    v = os.environ.get("LLMSVC_" + name.upper().replace("-", "_"))
    if v is None:
        return default
    if type_ is bool:
        return v.strip().lower() in ("1", "true", "yes", "on")
    return type_(v)


def add_arguments(p: argparse.ArgumentParser) -> None:
    def opt(flag, type_=str, default=None, **kw):
        name = flag.lstrip("-").replace("-", "_")
        env = "LLMSVC_" + name.upper()
        if type_ is bool:
            p.add_argument(flag, action="store_true", default=_env(name, False, bool), help=f"{kw.pop('help')} [{env}]")
        else:
            p.add_argument(flag, type=type_, default=_env(name, default, type_),
                           help=f"{kw.pop('help')} (default: {default}) [{env}]", **kw)

    p.add_argument("model", nargs="?", default=_env("model", None),
                   help="HF model directory or .gguf file (default: SmolLM2-135M-Instruct GGUF) [LLMSVC_MODEL]")
    opt("--host", str, "0.0.0.0", help="address to bind")
    opt("--port", int, 50051, help="port to bind (0 = any free port)")
    opt("--executor", str, "uniproc", choices=["uniproc", "multiproc", "tp"], help="where the model runs")
    opt("--tensor-parallel-size", int, 1, help="ranks for --executor tp")
    opt("--dtype", str, "float32", choices=["float32", "bfloat16", "float16"], help="model dtype")
    opt("--max-model-len", int, None, help="context length (default: the model's)")
    opt("--max-num-seqs", int, 128, help="max requests running at once")
    opt("--max-num-batched-tokens", int, 1024, help="token budget per step")
    opt("--kv-cache-memory", parse_bytes, "2GiB", help="KV cache budget, e.g. 2GiB")
    opt("--block-size", int, 16, help="tokens per KV block")
    opt("--no-prefix-caching", bool, help="disable prefix caching")
    opt("--max-waiting-requests", int, 4096, help="admission cap; past it RESOURCE_EXHAUSTED")
    opt("--device", str, "auto", choices=["auto", "cpu", "cuda"], help="device")
    opt("--shutdown-grace", float, 30.0, help="seconds in-flight requests get on SIGTERM")
    opt("--log-level", str, "INFO", help="logging level")


def build_config(args):
    from llmsvc.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
    kv = args.kv_cache_memory if isinstance(args.kv_cache_memory, int) else parse_bytes(args.kv_cache_memory)
    return EngineConfig(
        model_config=ModelConfig(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len),
        cache_config=CacheConfig(block_size=args.block_size, kv_cache_memory_bytes=kv,
                                 enable_prefix_caching=not args.no_prefix_caching),
        scheduler_config=SchedulerConfig(max_num_seqs=args.max_num_seqs,
                                         max_num_batched_tokens=args.max_num_batched_tokens,
                                         max_waiting_requests=args.max_waiting_requests),
        parallel_config=ParallelConfig(executor=args.executor, tensor_parallel_size=args.tensor_parallel_size),
        device=args.device)


async def serve(args) -> int:
    from llmsvc.server.app import LlmServer, default_engine_factory
    config = build_config(args)
    server = LlmServer(default_engine_factory(config), host=args.host, port=args.port,
                       max_waiting_requests=args.max_waiting_requests)
    server.shutdown_grace = args.shutdown_grace
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not the main thread / platform
            pass
    return await server.serve(stop)


def main(args) -> int:
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return asyncio.run(serve(args))
    except Exception:
        logging.getLogger("llmsvc.server").exception("server failed")
        return 1
