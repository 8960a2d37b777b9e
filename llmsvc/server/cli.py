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

import argparse
import asyncio
import logging
import os
import signal

from executors.registry import executor_names
from executors.registry import flag_help as executor_flag_help
from llmsvc.config import DTYPE_CHOICES, LOGPROBS_MODES, MEMORY_SIZE_HELP, QUANTIZATION_CHOICES
from llmsvc.server import event_loop
from llmsvc.server.cli_types import (LOG_LEVELS, env_default, env_name, fraction, json_object, log_level, lora_module,
                                     lora_modules_env, non_negative_float, non_negative_int, parse_bytes, port,
                                     positive_float, positive_int)


def add_arguments(p: argparse.ArgumentParser) -> None:
    def opt(flag, type_=str, default=None, **kw):
        name = flag.lstrip("-").replace("-", "_")
        env = env_name(name)
        if type_ is bool:
            p.add_argument(flag, action="store_true", default=env_default(name, False, bool), help=f"{kw.pop('help')} [{env}]")
        else:
            shown = f" (default: {default})" if default is not None else ""
            p.add_argument(flag, type=type_, default=env_default(name, default, type_, kw.get("choices")),
                           help=f"{kw.pop('help')}{shown} [{env}]", **kw)

    p.add_argument("model", nargs="?", default=env_default("model", None),
                   help="HF model directory or .gguf file (default: SmolLM2-135M-Instruct GGUF) [LLMSVC_MODEL]")
    opt("--served-model-name", str, None,
        help="the model's name in GetModelInfo and the logs (default: the model argument as given)")
    opt("--host", str, "127.0.0.1", help="address to bind (0.0.0.0: every interface, as in the container image)")
    opt("--port", port, 50051, help="port to bind (0 = any free port)")
    opt("--engine-core", str, "process", choices=["process", "inline"],
        help="where the scheduler and executor run: process (their own process behind ZeroMQ; this one "
             "keeps gRPC, tokenizing and detokenizing) or inline (a thread of this process)")
    opt("--executor", str, "auto", choices=["auto", *executor_names()],
        help=f"where the model runs: {executor_flag_help()}; auto: uniproc with --engine-core process, "
             "multiproc with inline (either way the gRPC threads and the model never share a GIL)")
    opt("--tensor-parallel-size", positive_int, 1, help="ranks for --executor tp")
    opt("--nnodes", positive_int, 1, help="machines sharing the --tensor-parallel-size ranks (multi-node TP)")
    opt("--node-rank", non_negative_int, 0, help="this machine's index; 0 serves gRPC, the others run headless workers")
    opt("--master-addr", str, "127.0.0.1", help="address of node 0, where ranks rendezvous (multi-node)")
    opt("--master-port", port, 0, help="rendezvous port on node 0; required when --nnodes > 1")
    opt("--dtype", str, "auto", choices=list(DTYPE_CHOICES),
        help="compute and KV-cache dtype; auto: the checkpoint's own (float16 runs as bfloat16 off CUDA)")
    opt("--quantization", str, "none", choices=list(QUANTIZATION_CHOICES),
        help="gguf: multiply a .gguf model's Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K linear weights "
             "as stored (CPU, float32: the logits of none, from a fraction of the weight bytes); int8: "
             "linear weights quantized per channel at load, activations per token, int8 GEMMs (CPU); none: "
             "dequantize every weight at load")
    opt("--max-model-len", positive_int, None, help="context length (default: the model's)")
    opt("--chat-template", str, None,
        help="Jinja chat template (a file, or the text itself) replacing the model's own, for chat prompts "
             "(default: the model's tokenizer_config.json)")
    opt("--tokenizer", str, None, help="directory of the tokenizer files to use instead of the model's")
    opt("--generation-config", str, "auto",
        help="defaults of unset sampling fields: auto (the model's generation_config.json), vllm (none: the "
             "neutral values), or a directory with a generation_config.json, or a JSON file")
    opt("--override-generation-config", json_object, None,
        help='JSON of sampling defaults over --generation-config\'s, e.g. \'{"temperature": 0.5}\'')
    p.add_argument("--lora-modules", nargs="+", type=lora_module, default=lora_modules_env(),
                   metavar="NAME=PATH", help="LoRA adapters (PEFT directories) served beside the model, each "
                   "picked by GenerateRequest.lora_name; implies --enable-lora [LLMSVC_LORA_MODULES]")
    opt("--enable-lora", bool, help="serve LoRA adapters: those of --lora-modules, and those AdminService."
        "LoadLoraAdapter loads while serving")
    opt("--max-lora-rank", positive_int, 16, help="largest LoRA rank accepted; adapter weights are padded to it")
    opt("--max-loras", positive_int, None, help="LoRA adapters loaded at once (every worker keeps a slot for "
        "each; default: the number of --lora-modules, at least 1)")
    opt("--seed", non_negative_int, 0, help="seed of the model's random initialisation and of the seeds given to sampled "
        "requests that set none (SamplingParams.seed)")
    opt("--max-num-seqs", positive_int, 128, help="max requests running at once")
    opt("--logprobs-mode", str, "raw_logprobs", choices=list(LOGPROBS_MODES),
        help="sampled tokens' logprobs: the model's distribution, or the one sampled from (after penalties, "
             "temperature, top-k/p, min-p)")
    opt("--max-logprobs", non_negative_int, 20, help="largest logprobs / prompt_logprobs a request may ask for")
    opt("--max-num-batched-tokens", positive_int, 1024, help="token budget per step")
    opt("--kv-cache-memory", parse_bytes, "2GiB", help=f"KV cache budget, e.g. 2GiB or 2G ({MEMORY_SIZE_HELP})")
    opt("--gpu-memory-utilization", fraction, 0.9,
        help="CUDA: the share of the GPU's memory this server may fill; the KV cache gets what the weights "
             "and a profiled step leave of it")
    opt("--enforce-eager", bool, help="CUDA: run every step eagerly, without capturing decode steps in CUDA "
        "graphs")
    opt("--block-size", positive_int, 16, help="tokens per KV block")
    opt("--swap-space", parse_bytes, "0", help="host memory per worker for swapped-out requests' KV blocks and "
        f"prefix-cache blocks evicted from the KV cache (pinned on CUDA), e.g. 4GiB; 0: none ({MEMORY_SIZE_HELP})")
    opt("--preemption-mode", str, "auto", choices=["auto", "recompute", "swap"],
        help="a running request preempted under KV pressure: recompute (drop its blocks, prefill again) or swap "
             "(copy them to --swap-space and back; recompute when it is full); auto: swap when there is a swap space")
    opt("--no-prefix-caching", bool, help="disable prefix caching")
    opt("--no-vllm-engine", bool, help="serve llmsvc.v1 alone: without vLLM's engine protocol "
        "(vllm.grpc.engine.VllmEngine, which the SMG gateway drives workers with) on the same port")
    opt("--max-waiting-requests", non_negative_int, 4096,
        help="admission cap: requests in flight beyond those that can run; past it RESOURCE_EXHAUSTED "
             "(0: none wait)")
    opt("--scheduling-policy", str, "fcfs", choices=["fcfs", "priority"],
        help="fcfs: first come, first served; priority: waiting requests by (GenerateRequest.priority, "
             "arrival), lower first, and a more urgent arrival may preempt a running less urgent request")
    opt("--device", str, "auto", choices=["auto", "cpu", "cuda"], help="device")
    opt("--async-scheduling", bool, help="schedule the next step while the model computes this one "
        "(pays on a GPU, where the host's scheduling otherwise leaves it idle between steps; see "
        "docs/engine-core.md)")
    opt("--speculative-config", json_object, None,
        help='speculative decoding by prompt lookup, as vLLM\'s: \'{"method": "ngram", "num_speculative_tokens": 4, '
             '"prompt_lookup_min": 3, "prompt_lookup_max": 5}\' (also "disable_by_batch_size"); tokens are those '
             'of decoding without it (docs/spec-decode.md); excludes --async-scheduling')
    opt("--stream-interval", positive_int, 1,
        help="new tokens per streamed message (the first token and the end go at once); larger values cost "
             "the server less CPU per token, which on a small CPU box the model gets back (a request's "
             "OutputOptions.stream_interval may ask for more)")
    opt("--burst-wait-ms", non_negative_float, 5.0,
        help="after an idle spell, the engine core takes requests while they keep arriving within this many "
             "ms of each other (or 2%% of their step's expected time, if less; 10 gaps at most, until a "
             "step's token budget is queued) before its first step, so that a client's batch starts as one "
             "step; 0: step at the first request")
    opt("--event-loop", str, "auto", choices=["auto", "uvloop", "asyncio"],
        help="the server's asyncio event loop: uvloop (less CPU per streamed message) or asyncio's own; auto: "
             "uvloop where installed")
    opt("--grammar-compile-timeout", positive_float, 10.0,
        help="seconds a structured-output constraint may take to compile; longer fails with INVALID_ARGUMENT")
    opt("--grammar-cache-size", positive_int, 256, help="compiled structured-output grammars kept (LRU)")
    opt("--shutdown-grace", non_negative_float, 30.0,
        help="seconds in-flight requests get on SIGTERM (a second SIGTERM/SIGINT ends it)")
    opt("--log-level", log_level, "INFO", help=f"logging level: {', '.join(LOG_LEVELS)}")
    opt("--log-format", str, "text", choices=["text", "json"], help="log lines as text or one JSON object each")
    opt("--disable-log-requests", bool, help="no INFO line per finished or cancelled request (the periodic "
        "throughput line and the request metrics stay)")
    opt("--metrics-port", port, 0, help="Prometheus /metrics HTTP port (0 = off)")
    opt("--metrics-host", str, None, help="address for the metrics port (default: --host)")
    opt("--metrics-label-keys", str, "",
        help="comma-separated GenerateRequest.labels keys (e.g. tenant) that become Prometheus labels of the "
             "per-request series; other keys only reach the logs (at most 100 values per key, then 'other')")
    opt("--otlp-traces-endpoint", str, None,
        help="OpenTelemetry collector (OTLP/gRPC, e.g. http://collector:4317) that gets a span per Generate "
             "call, child of the caller's traceparent (needs the otel extra)")
    opt("--tls-cert", str, None, help="PEM server certificate (chain); with --tls-key enables TLS")
    opt("--tls-key", str, None, help="PEM private key of --tls-cert")
    opt("--tls-client-ca", str, None, help="PEM CA bundle; clients must present a certificate it signed (mTLS)")
    opt("--auth-token-file", str, None,
        help="file of accepted bearer tokens, one per line; tokens may also come comma-separated from "
             "LLMSVC_AUTH_TOKENS. Health and reflection need no token")
    opt("--admin-token-file", str, None,
        help="file of the bearer tokens AdminService (Drain, FlushCache, Load/UnloadLoraAdapter) accepts, one "
             "per line; also comma-separated from LLMSVC_ADMIN_TOKENS. Without any, admin calls get "
             "PERMISSION_DENIED")


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
    admin = load_tokens(args.admin_token_file, os.environ.get(ADMIN_TOKENS_ENV))
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
