"""`llmsvc bench`: standard or custom workloads, offline and/or over gRPC, with the HF peer and the
machine's arithmetic ceiling measured in the same run, printed as ratios."""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import signal
import sys
import time

from executors.registry import executor_names
from llmsvc.bench.after_runs import (compare_again, print_ceiling, print_grpc_ratio, print_quantization_ratio,
                                     quantized_systems, run_sweeps, structured_run)
from llmsvc.bench.compare import (check_peer_args, parse_baselines, peer_systems, print_ratios, print_spreads,
                                   record_runs, vllm_peer)
from llmsvc.bench.fairness import IDLE_WAIT_S, check_held, parse_held
from llmsvc.bench.metrics import summarize
from llmsvc.bench.openai_peer import (ChatPrompts, as_chat, check_endpoints, openai_systems, parse_endpoint,
                                      print_openai_ratios)
from llmsvc.bench.probe import RpcProbe, merged_summary, print_latency
from llmsvc.bench.report import Tally
from llmsvc.bench.repeat import System, alternate
from llmsvc.bench.vllm_peer import PeerError
from llmsvc.bench.workloads import Workload, arrival_offsets, build_prompts, get_workload, load_workloads, ordinary_vocab
from llmsvc.client.cli_common import int_in, positive_float, readable_file
from llmsvc.config import DTYPES, QUANTIZATION_CHOICES


def comma_list(item):
    """An argparse type: a comma list whose every item `item` accepts. The text itself is kept:
    the sweep parses it, and the results record it as given."""
    def parse(text: str) -> str:
        for x in text.split(","):
            item(x.strip())
        return text
    return parse


# the custom-workload flags: each overrides the Workload field of its name
CUSTOM_FIELDS = (("num-requests", int_in(1)), ("input-len", int_in(1)), ("output-len", int_in(1)),
                 ("rate", positive_float), ("concurrency", int_in(1)), ("shared-prefix-len", int_in(0)),
                 ("num-prefixes", int_in(1)), ("seed", int))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None, help="HF directory or .gguf (default: SmolLM2-135M-Instruct)")
    p.add_argument("--workload", action="append",
                   help=f"one of the packaged workloads ({', '.join(load_workloads())}; repeatable); default W2")
    g = p.add_argument_group("custom workload (overrides fields of --workload, or defines one)")
    for name, typ in CUSTOM_FIELDS:
        g.add_argument(f"--{name}", type=typ, default=None)
    p.add_argument("--mode", choices=["serve", "offline", "both"], default="serve",
                   help="serve: over gRPC; offline: in-process engine; both: and print the gRPC cost")
    p.add_argument("--server", default=None, help="HOST:PORT of a running server (else one is started)")
    p.add_argument("--baseline", type=parse_baselines, default=[], metavar="{none,hf,vllm}",
                   help="also run peers on the same prompts, comma-separated: hf (transformers generate), "
                        "vllm (needs --vllm-python; docs/benchmarks.md)")
    p.add_argument("--vllm-python", default=None, metavar="PATH", help="the interpreter of a venv with vLLM")
    p.add_argument("--openai", action="append", type=parse_endpoint, default=[], metavar="[NAME=]URL",
                   help="also drive this OpenAI-compatible endpoint (e.g. SMG in front of llmsvc or of vLLM's "
                        "gRPC worker) with the same prompts as streamed chat completions; repeatable. The "
                        "first is compared with llmsvc's gRPC run and with the others (docs/benchmarks.md)")
    p.add_argument("--freeze", action="append", type=parse_held, default=[], metavar="NAME[,NAME...]=PID",
                   help="a process group the bench did not start (e.g. SMG and its worker, under setsid): "
                        "stopped (SIGSTOP) while any system but NAMES runs; NAME: llmsvc, vllm or an --openai name")
    p.add_argument("--repeat", type=int, default=1, help="measure ours and each peer N times, taking turns, "
                   "and compare medians (use 3 for ratios on a shared machine)")
    p.add_argument("--idle-wait", type=float, default=IDLE_WAIT_S, metavar="SECONDS",
                   help="before each run, wait up to this long for the box to be idle (CPU busy below "
                        "--idle-busy over 1 s); 0: sample once and measure; below 0: no check "
                        "(default 30, or $LLMSVC_BENCH_IDLE_WAIT; docs/benchmarks.md)")
    p.add_argument("--idle-busy", type=float, default=0.15, metavar="FRACTION",
                   help="the busy fraction of all CPUs below which the box counts as idle")
    p.add_argument("--hf-batch-size", type=int, default=64)
    p.add_argument("--ceiling", action="store_true", help="measure GEMM FLOP/s and print the tokens/s ceiling")
    p.add_argument("--compare-prefix-caching", action="store_true", help="run again with prefix caching off")
    p.add_argument("--compare-quantization", choices=[q for q in QUANTIZATION_CHOICES if q != "auto"],
                   help="also run our engine with --quantization Q, in turns with the run as given; print the ratios")
    p.add_argument("--compare-preemption", action="store_true",
                   help="run again with --preemption-mode recompute and no swap space, and print swap's output tok/s "
                        "against it (give --swap-space and a small --kv-cache-memory, e.g. --workload PR1 "
                        "--kv-cache-memory 24MiB --swap-space 512MiB; docs/swap.md)")
    p.add_argument("--sweep-rate", type=comma_list(positive_float), default=None,
                   help="comma list of Poisson rates (req/s) to sweep")
    p.add_argument("--sweep-concurrency", type=comma_list(int_in(1)), default=None,
                   help="comma list of concurrency caps to sweep")
    p.add_argument("--json", default=None, help="write all results to this file")
    p.add_argument("--executors", default=None,
                   help=f"comma list ({','.join(executor_names())}): compare executors offline on one workload "
                        "(llmsvc.bench.executors); --tensor-parallel-size > 1 sets tp's ranks")
    p.add_argument("--plot", default=None, help="write a PNG of the sweep (or throughput bars)")
    p.add_argument("--json-schema", type=readable_file, default=None, metavar="FILE",
                   help="run each workload again with this JSON Schema constraint on every request, then "
                        "unconstrained once more (same mode): print its output tok/s against the mean "
                        "of the unconstrained runs, and the schema's compile time")
    e = p.add_argument_group("engine (passed to the server it starts, or used offline)")
    # explicit: the peers (HF, vLLM) and the ceiling run in the dtype named here
    e.add_argument("--dtype", default="float32", choices=list(DTYPES))
    e.add_argument("--quantization", default="auto", choices=list(QUANTIZATION_CHOICES),
                   help="as `llmsvc serve`'s, resolved once and printed (the peers and the ceiling keep the "
                        "dequantized weights)")
    e.add_argument("--executor", default="auto", help="as `llmsvc serve`'s; auto: its default when serving, "
                   "uniproc (the model in this process, as LLM) offline")
    e.add_argument("--engine-core", default="process", choices=["process", "inline"],
                   help="as `llmsvc serve`'s, whose default this is (offline runs are always inline)")
    e.add_argument("--tensor-parallel-size", type=int, default=1)
    e.add_argument("--max-num-seqs", type=int, default=None)
    e.add_argument("--max-num-batched-tokens", type=int, default=None)
    e.add_argument("--kv-cache-memory", default=None)
    e.add_argument("--swap-space", default=None, help="as `llmsvc serve`'s")
    e.add_argument("--preemption-mode", default=None, choices=["auto", "recompute", "swap"], help="as `llmsvc serve`'s")
    e.add_argument("--async-scheduling", action="store_true", help="as `llmsvc serve`'s")
    e.add_argument("--stream-interval", type=int, default=None, help="as `llmsvc serve`'s")
    e.add_argument("--speculative-config", default=None, metavar="JSON", help="as `llmsvc serve`'s")


def _serve_args(a, prefix_caching: bool = True) -> list[str]:
    out = ([a.model] if a.model else []) + ["--dtype", a.dtype, "--quantization", getattr(a, "quantization", "none"),
                                            "--executor", a.executor, "--engine-core", a.engine_core,
                                            "--tensor-parallel-size", str(a.tensor_parallel_size)]
    for flag in ("max_num_seqs", "max_num_batched_tokens", "kv_cache_memory", "stream_interval",
                 "speculative_config", "swap_space", "preemption_mode"):
        if getattr(a, flag, None) is not None:
            out += ["--" + flag.replace("_", "-"), str(getattr(a, flag))]
    return (out + ([] if prefix_caching else ["--no-prefix-caching"])
            + (["--async-scheduling"] if a.async_scheduling else []))


def _workloads(a) -> list[Workload]:
    names = a.workload or (["custom"] if a.input_len else ["W2"])
    out = []
    for name in names:
        w = get_workload(name)
        fields = [f.replace("-", "_") for f, _ in CUSTOM_FIELDS]
        over = {k: getattr(a, k) for k in fields if getattr(a, k, None) is not None}
        if over.get("rate"):
            over["arrival"] = "poisson"
        w = dataclasses.replace(w, **over)
        if w.shared_prefix_len > w.input_len:
            raise ValueError(f"{w.name}: the shared prefix ({w.shared_prefix_len} tokens) is longer than "
                             f"the prompts ({w.input_len} tokens)")
        out.append(w)
    return out


def _offline_engine(a, prefix_caching: bool = True):
    """An in-process LLMEngine configured as `llmsvc serve` would be with the same flags."""
    from llmsvc.config import EngineConfig
    from llmsvc.engine.llm_engine import LLMEngine

    return LLMEngine.from_config(EngineConfig.from_options(
        model=a.model, dtype=a.dtype, quantization=getattr(a, "quantization", None),
        enable_prefix_caching=prefix_caching,
        max_num_seqs=a.max_num_seqs or None,
        max_num_batched_tokens=a.max_num_batched_tokens or None, kv_cache_memory=a.kv_cache_memory or None,
        executor="uniproc" if a.executor == "auto" else a.executor, tensor_parallel_size=a.tensor_parallel_size,
        async_scheduling=a.async_scheduling, stream_interval=a.stream_interval,
        speculative_config=getattr(a, "speculative_config", None), swap_space=getattr(a, "swap_space", None),
        preemption_mode=getattr(a, "preemption_mode", None)))


def run_workload(a, w: Workload, model_dir: str, vocab: list[int], results: dict, tally: Tally,
                 vllm=None, chat: ChatPrompts | None = None) -> None:
    from llmsvc.bench.fairness import Turns, wait_idle, warmup_prompts
    from llmsvc.bench.runners import run_offline, run_serving
    from llmsvc.bench.server_proc import flush_server_cache, running_server, wait_serving

    prompts, texts = as_chat(build_prompts(w, vocab), chat)
    offsets = arrival_offsets(w)
    res = results["workloads"].setdefault(w.name, {"workload": dataclasses.asdict(w)})
    print(f"\n== {w.name}: {w.num_requests} requests x {w.input_len} in / {w.output_len} out, "
          f"{w.arrival}{f' {w.rate}/s' if w.rate else ''}")

    probes: list[RpcProbe] = []  # every run's, so that --repeat reports the calls of all runs

    def serve(prefix_caching=True, rate=None, concurrency=None, json_schema=None, probe=False, flags=a):
        offs = offsets if rate is None else arrival_offsets(dataclasses.replace(w, arrival="poisson", rate=rate))
        conc = concurrency or w.concurrency
        with contextlib.ExitStack() as stack:
            if a.server:
                wait_serving(a.server, timeout=180.0)  # a server still loading answers UNAVAILABLE
                target = a.server
            else:
                target = stack.enter_context(running_server(_serve_args(flags, prefix_caching)))
            warm = warmup_prompts(prompts)  # outside the clock
            run_serving(target, warm, 2, [0.0] * len(warm), conc)
            if a.server and not flush_server_cache(target):  # earlier runs' prompts would be cached
                print(f"  note: could not flush {target}'s prefix cache (VllmEngine/FlushCache)")
            rpc = stack.enter_context(RpcProbe(target)) if probe else None
            recs, wall = run_serving(target, prompts, w.output_len, offs, conc, json_schema)
        if rpc is not None:  # small RPCs alongside the workload: how long they waited
            probes.append(rpc)
            res["rpc_latency"] = merged_summary(probes)
            print_latency(rpc.summary())
        return recs, summarize(recs, wall)

    def offline(prefix_caching=True, json_schema=None, flags=a):
        engine = _offline_engine(flags, prefix_caching)
        try:
            warm = warmup_prompts(prompts)  # outside the clock
            run_offline(engine, warm, 2, [0.0] * len(warm))
            recs, wall = run_offline(engine, prompts, w.output_len, offsets, json_schema)
        finally:
            engine.shutdown()
        return recs, summarize(recs, wall)

    systems = []
    if a.mode in ("offline", "both"):
        systems.append(System("offline", "llmsvc offline", lambda: offline()[1]))
    if a.mode in ("serve", "both"):
        systems.append(System("serve", "llmsvc gRPC", lambda: serve(probe=True)[1]))
    systems += quantized_systems(a, offline, serve)
    systems += peer_systems(a, w, prompts, offsets, model_dir, vllm)
    if texts is not None:
        systems += openai_systems(a.openai, texts, prompts, w.output_len, offsets, w.concurrency)[0]
    # the peer frozen while ours runs, an idle box before every run (fairness.py)
    turns = Turns(vllm.process_groups if vllm is not None else list, {"vllm"},
                  idle=lambda: wait_idle(a.idle_busy, a.idle_wait), threshold=a.idle_busy,
                  held=getattr(a, "freeze", []))
    try:
        runs = alternate(systems, a.repeat, lambda s, i, summary: tally.report(
            s.label + (f" [{i + 1}/{a.repeat}]" if a.repeat > 1 else ""), summary),
            before=lambda s: turns.before(s.key, s.label))
    finally:
        turns.resume()
    record_runs(res, systems, runs)
    print_spreads(res, systems)
    if len(probes) > 1:
        print_latency(res["rpc_latency"], f", {len(probes)} runs")
    if a.mode == "both":
        print_grpc_ratio(res)
    ours = res.get("serve") or res["offline"]
    if a.json_schema:
        structured_run(a, res, model_dir, offline, serve, tally)
    print_quantization_ratio(a, res)
    compare_again(a, res, ours, offline, serve, tally)
    print_ratios(w, res, a.baseline)
    print_openai_ratios(res, getattr(a, "openai", []))
    if a.ceiling:
        print_ceiling(a, w, res, ours, model_dir)
    run_sweeps(a, res, serve, tally)


def main(a) -> int:
    if getattr(a, "executors", None):
        from llmsvc.bench import executors

        return executors.main_from_bench(a)
    if a.server and (a.compare_prefix_caching or getattr(a, "compare_quantization", None)):
        # the second run needs a server started with prefix caching off, or quantized
        print("llmsvc bench: --compare-prefix-caching and --compare-quantization start their own "
              "servers; they cannot be used with --server", file=sys.stderr)
        return 2
    try:
        workloads = _workloads(a)
    except ValueError as e:
        print(f"llmsvc bench: {e}", file=sys.stderr)
        return 2
    if (why := check_peer_args(a) or check_endpoints(getattr(a, "openai", []))
            or check_held(getattr(a, "freeze", []), [e.name for e in getattr(a, "openai", [])])) is not None:
        print(f"llmsvc bench: {why}", file=sys.stderr)
        return 2
    from llmsvc.config import ModelConfig
    from llmsvc.models.resolve import resolve_model_config
    from transformers import AutoTokenizer

    try:  # "auto" resolved once here, so that every run, the ceiling and the JSON name the same
        mc = resolve_model_config(ModelConfig(model=a.model, dtype=a.dtype, quantization=a.quantization))
    except ValueError as e:
        print(f"llmsvc bench: {e}", file=sys.stderr)
        return 2
    if a.quantization == "auto":
        print(f"quantization auto: {mc.quantization}")
    a.quantization = mc.quantization
    if getattr(a, "compare_quantization", None) == a.quantization:
        print(f"llmsvc bench: --compare-quantization {a.quantization} is what the runs as given use "
              f"(pass --quantization to set those)", file=sys.stderr)
        return 2
    tokenizer = AutoTokenizer.from_pretrained(mc.model_dir)
    vocab = ordinary_vocab(tokenizer)
    chat = ChatPrompts(tokenizer) if getattr(a, "openai", None) else None
    results = {"started": time.strftime("%Y-%m-%dT%H:%M:%S"), "workloads": {},
               "args": {k: v for k, v in vars(a).items() if not k.startswith("_")}}
    if hasattr(a, "_vllm_version"):
        results["vllm_version"] = a._vllm_version
    # SIGTERM unwinds like Ctrl-C, so that the servers and peers this run started are stopped
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    tally = Tally()
    with contextlib.ExitStack() as stack:  # the peers' children stop on any exit, Ctrl-C included
        vllm = stack.enter_context(vllm_peer(a, mc.model_dir))
        try:
            for w in workloads:
                run_workload(a, w, mc.model_dir, vocab, results, tally, vllm, chat)
        except PeerError as e:  # vLLM failed to start or died: its log's tail says why
            print(f"llmsvc bench: {e}", file=sys.stderr)
            return 1
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=2, default=str)
        print(f"\nwrote {a.json}")
    if a.plot:
        from llmsvc.bench.plot import plot_results

        plot_results(results, a.plot)
        print(f"wrote {a.plot}")
    if tally.failed:  # figures measured over failed requests are not the workload's
        print(f"llmsvc bench: {tally.failed} of {tally.requests} requests failed (the FAILED lines above "
              "say why)", file=sys.stderr)
        return 1
    return 0
