"""`llmsvc serve [MODEL]`: start the gRPC server. Every flag can also come from LLMSVC_<FLAG>.

Logs "listening on HOST:PORT" once bound and "ready" once the model is loaded and warmed up.
SIGTERM/SIGINT drain gracefully (NOT_SERVING, new requests UNAVAILABLE, in-flight requests
get --shutdown-grace seconds; a second signal aborts them at once). Exit code 1 when the
engine died, so an orchestrator restarts it.
Multi-node tensor parallelism: --nnodes/--node-rank/--master-addr/--master-port; node 0 serves,
nodes with --node-rank > 0 run their ranks headless (no gRPC) and exit when node 0 goes away.
Operations: --metrics-port (Prometheus /metrics), --tls-cert/--tls-key[/--tls-client-ca],
--auth-token-file and/or LLMSVC_AUTH_TOKENS (bearer tokens), --log-format text|json.
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal

from llmsvc.config import num_threads_env
from llmsvc.server import event_loop
from llmsvc.server.cli_flags import add_arguments  # noqa: F401 - `llmsvc serve`'s flags, declared there


def build_config(args):
    from llmsvc.config import EngineConfig
    return EngineConfig.from_options(
        model=args.model, served_name=args.served_model_name, tokenizer=args.tokenizer, dtype=args.dtype,
        quantization=args.quantization,
        seed=args.seed,
        chat_template=args.chat_template, enforce_eager=args.enforce_eager or None,
        generation_config=args.generation_config, override_generation_config=args.override_generation_config,
        gpu_memory_utilization=args.gpu_memory_utilization, max_model_len=args.max_model_len, block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory, enable_prefix_caching=not args.no_prefix_caching,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_logprobs=args.max_logprobs, logprobs_mode=args.logprobs_mode,
        max_waiting_requests=args.max_waiting_requests, policy=args.scheduling_policy, executor=executor_name(args),
        tensor_parallel_size=args.tensor_parallel_size, device=args.device, engine_core=args.engine_core,
        grammar_compile_timeout_s=args.grammar_compile_timeout, grammar_cache_size=args.grammar_cache_size,
        async_scheduling=args.async_scheduling, stream_interval=args.stream_interval,
        burst_wait_ms=args.burst_wait_ms, speculative_config=args.speculative_config,
        swap_space=args.swap_space, preemption_mode=args.preemption_mode,
        **_lora(args), **_multi_node(args))


def _lora(args) -> dict:
    modules = dict(args.lora_modules or ())
    if len(modules) != len(args.lora_modules or ()):
        raise ValueError("--lora-modules: each adapter name may appear once")
    if not modules and not args.enable_lora:
        return {}
    return {"lora_modules": modules, "enable_lora": True, "max_lora_rank": args.max_lora_rank,
            "max_loras": args.max_loras}


def executor_name(args) -> str:
    """--executor with "auto" resolved: the model never shares a GIL with the gRPC threads."""
    if args.executor != "auto":
        return args.executor
    return "uniproc" if args.engine_core == "process" else "multiproc"


def _multi_node(args) -> dict:
    """ParallelConfig fields of the multi-node flags (ValueError when they do not fit together)."""
    nnodes, node_rank = args.nnodes, args.node_rank
    addr, port = args.master_addr, args.master_port
    if nnodes > 1:
        tp = args.tensor_parallel_size
        if not 0 <= node_rank < nnodes:
            raise ValueError(f"--node-rank must be in [0, {nnodes}), got {node_rank}")
        if tp < nnodes or tp % nnodes:
            raise ValueError(f"--tensor-parallel-size ({tp}) must be a multiple of --nnodes ({nnodes})")
        if not port:
            raise ValueError("--master-port is required with --nnodes > 1 (the same on every node)")
    elif node_rank:
        raise ValueError("--node-rank needs --nnodes > 1")
    return dict(nnodes=nnodes, node_rank=node_rank, master_addr=addr, master_port=port)


def run_headless(args, config=None) -> int:
    """Node k > 0 of a multi-node TP group: this machine's ranks, no gRPC server. SIGTERM stops them."""
    import threading

    from executors.headless import run_headless as run
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    return run(build_config(args) if config is None else config, stop)


def security_options(args) -> dict:
    """TLS and auth keyword arguments of LlmServer from the flags, LLMSVC_AUTH_TOKENS and
    LLMSVC_ADMIN_TOKENS (ValueError if bad)."""
    from llmsvc.server.auth import ADMIN_TOKENS_ENV, TOKENS_ENV, load_tokens
    from llmsvc.server.tls import TlsConfig
    tls = TlsConfig.from_args(args.tls_cert, args.tls_key, args.tls_client_ca)
    if tls is not None:
        tls.server_credentials()  # fail at startup on unreadable files
    tokens = load_tokens(args.auth_token_file, os.environ.get(TOKENS_ENV))
    admin = load_tokens(args.admin_token_file, os.environ.get(ADMIN_TOKENS_ENV), flag="--admin-token-file")
    return dict(tls=tls, auth_tokens=tokens or None, admin_tokens=admin or None)


def tracing_options(args) -> dict:
    """LlmServer's `tracer` for --otlp-traces-endpoint (ValueError without the otel extra)."""
    if not args.otlp_traces_endpoint:
        return {}
    from llmsvc.server.tracing import RequestTracer
    try:
        return dict(tracer=RequestTracer(args.otlp_traces_endpoint))
    except RuntimeError as e:
        raise ValueError(str(e)) from None


async def serve(args, security: dict | None = None, config=None) -> int:
    config = build_config(args) if config is None else config
    core_start = None
    if config.engine_core == "process":  # the core's interpreter, torch import and model load overlap ours
        import concurrent.futures

        from llmsvc.engine.llm_engine import start_engine_core
        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="core-start")
        core_start = pool.submit(start_engine_core, config)
        pool.shutdown(wait=False)
    from llmsvc.server.app import LlmServer, default_engine_factory
    from llmsvc.server.metrics import parse_label_keys
    security = {**security_options(args), **tracing_options(args)} if security is None else security
    metrics_port = args.metrics_port or None
    server = LlmServer(default_engine_factory(config, core_start), host=args.host, port=args.port,
                       max_waiting_requests=args.max_waiting_requests, metrics_port=metrics_port,
                       metrics_host=args.metrics_host,
                       metrics_label_keys=parse_label_keys(args.metrics_label_keys),
                       log_requests=not args.disable_log_requests, vllm_engine=not args.no_vllm_engine,
                       **security)
    server.shutdown_grace = args.shutdown_grace
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal() -> None:  # the first drains for --shutdown-grace (at most); a second one cuts that short
        if stop.is_set():
            logging.getLogger("llmsvc.server").warning("second stop signal: aborting in-flight requests now")
            server.end_grace()
        else:
            server.stop_signal()
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, on_signal)
        except (NotImplementedError, RuntimeError):  # not the main thread / platform
            pass
    return await server.serve(stop)


def main(args) -> int:
    from llmsvc.server.logging_setup import setup_logging
    from llmsvc.server.metrics import parse_label_keys
    setup_logging(args.log_level, args.log_format)
    log = logging.getLogger("llmsvc.server")
    try:  # what can be checked before anything starts: one line, exit 2, no traceback
        config = build_config(args)  # sizes, multi-node flags, speculative config, LoRA names
        num_threads_env()
        parse_label_keys(args.metrics_label_keys)
        security = {**security_options(args), **tracing_options(args)}
        loop = event_loop.resolve(args.event_loop)
    except (ValueError, OSError) as e:  # TLS files, token file, multi-node flags: no traceback
        log.error("bad configuration: %s", e)
        return 2
    if args.node_rank > 0:
        try:
            return run_headless(args, config)
        except Exception:
            log.exception("headless node failed")
            return 1
    from llmsvc.server.app import BindError
    try:
        return event_loop.run(serve(args, security, config), loop)
    except BindError as e:
        log.error("%s", e)
        return 1
    except (ValueError, FileNotFoundError) as e:  # found on resolving the model: a path, the tokenizer, the TP size, the device
        log.error("bad configuration: %s", e)
        log.debug("bad configuration", exc_info=True)
        return 2
    except Exception:
        log.exception("server failed")
        return 1
