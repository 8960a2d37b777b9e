"""The flags of `llmsvc serve`, in groups; every flag has an LLMSVC_<FLAG> environment twin.

`add_arguments` is the one place they are declared: `llmsvc serve --help`, the env twins and
`build_config` (llmsvc/server/cli.py) all read what is declared here.
"""
from __future__ import annotations

import argparse
from typing import Callable

from executors.registry import executor_names
from executors.registry import flag_help as executor_flag_help
from llmsvc.config import DTYPE_CHOICES, LOGPROBS_MODES, MEMORY_SIZE_HELP, QUANTIZATION_CHOICES
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

    _model_flags(p, opt)
    _engine_flags(p, opt)
    _serving_flags(p, opt)
    _operations_flags(p, opt)


def _model_flags(p: argparse.ArgumentParser, opt: Callable) -> None:
    """The model: what is served, from where, in which dtype, with which adapters and defaults."""
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
    opt("--quantization", str, "auto", choices=list(QUANTIZATION_CHOICES),
        help="auto: gguf for a .gguf model in float32 on the CPU (the default model: the same tokens as "
             "none, about 2x faster decode steps of one sequence), else none; gguf: multiply a .gguf "
             "model's Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K linear weights as stored (CPU, "
             "float32: the logits of none, from a fraction of the weight bytes); int8: linear weights "
             "quantized per channel at load, activations per token, int8 GEMMs (CPU); none: dequantize "
             "every weight at load")
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


def _engine_flags(p: argparse.ArgumentParser, opt: Callable) -> None:
    """The engine: scheduling, KV cache, swap, decoding."""
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


def _serving_flags(p: argparse.ArgumentParser, opt: Callable) -> None:
    """Serving: admission, streaming, policies, the event loop, grammars."""
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


def _operations_flags(p: argparse.ArgumentParser, opt: Callable) -> None:
    """Operations: shutdown, logs, metrics, tracing, TLS, tokens."""
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
