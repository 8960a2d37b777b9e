"""Soak: N minutes of mixed, partly abusive traffic against one llmsvc server, watching for leaks.

    python -m benchmarks.soak                      # starts `llmsvc serve` (default model), 10 minutes
    python -m benchmarks.soak --minutes 2 --model /path/to/tiny-model-dir
    python -m benchmarks.soak --server 127.0.0.1:50051 --server-pid 1234
    python -m benchmarks.soak --lora --minutes 3   # also LoRA traffic and adapter load/unload churn
    python -m benchmarks.soak --swap --minutes 3   # swap-preemption: aborts of swapped requests

Traffic (benchmarks/soak_traffic.py; each client thread draws one kind per request): streamed
and unary completions, n=2, stop strings, chat, client cancels mid-stream, Abort RPCs, short
deadlines, slow readers, bad requests. Every --interval seconds it samples the RSS of the server
process and its children and the KV free block count (GetServerInfo) and prints a table row. With
--lora the started server serves a random adapter ("soak") and may hold a second ("churn") that a
thread loads and unloads every ~2 s through AdminService while requests name either, or none, or
an unknown one. At the end it waits for the server to go idle and prints a JSON summary:
start/end/max RSS, free blocks at the end == total, calls by status code. Exit code 0 when
nothing leaked (all blocks free, nothing running/waiting, no INTERNAL/UNKNOWN/UNAVAILABLE).

--swap (or --swap-space SIZE, default 64MiB) starts the server with `--preemption-mode swap
--swap-space SIZE`, a 24MiB KV cache (34 blocks of the default model, float32) and up to 160 new
tokens a request, so running requests are swapped out to host memory and back all the time (the
first swap-out within seconds). Its traffic adds disconnects, draws half its requests from the
kinds that end a request early, and aims each such ending at the moment its stream falls silent
while the server reports swapped requests (soak_traffic.py says how). Rows gain the swapped
requests, the swap space's free blocks and the swap-outs so far (/metrics: the started server gets
a metrics port; give --metrics-url with --server); the summary gains the swap space's free/total
blocks at the end, all_swap_blocks_free_end, swap_outs, swap_ins and ended_while_swapped =
swap_outs - swap_ins - swapped at the end, the swapped requests that a cancel, abort, disconnect
or deadline ended while they were swapped out (a swap-in is the only other way out of the swapped
queue). Against any server with a swap space the exit code also requires that space entirely free
and nothing swapped at the end; with --swap, at least one swap-out and one request ended while
swapped out as well (else the run proved nothing, and says so). Not guaranteed: that each kind of
ending hit a swapped request (the server counts them in total, not by cause); a client learns that
its request was swapped only from a final message's Timing.num_swaps
(swapped_seen_by_kind_and_finish), which counts the swaps the request came back from.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

from benchmarks.soak_probe import rss_bytes, swap_counters, wait_idle
from benchmarks.soak_traffic import ADMIN_TOKEN, LORA_NAMES, Traffic, lora_churn
from llmsvc.bench.server_proc import free_port, stop_server, wait_serving
from llmsvc.v1 import llmsvc_pb2 as pb

BAD_CODES = ("INTERNAL", "UNKNOWN", "UNAVAILABLE")
# (KV cache, max tokens) by mode. Swap: 34 blocks of the default model hold one 512-token
# request (nothing is refused for size) but not six clients' requests of up to ~70 + 160 tokens
PLAIN_DEFAULTS = ("48MiB", 48)
SWAP_DEFAULTS = ("24MiB", 160)
SWAP_SPACE = "64MiB"


def _lora_flags(args, tmp: str) -> list[str]:
    from benchmarks.lora import write_random_adapter
    from llmsvc.config import ModelConfig
    from llmsvc.models.resolve import resolve_model_config

    args.lora_path = write_random_adapter(resolve_model_config(ModelConfig(model=args.model)),
                                          os.path.join(tmp, "adapter"), 8)
    with open(os.path.join(tmp, "admin-tokens"), "w") as f:
        f.write(ADMIN_TOKEN + "\n")
    return ["--lora-modules", f"soak={args.lora_path}", "--max-loras", "2", "--max-lora-rank", "8",
            "--admin-token-file", os.path.join(tmp, "admin-tokens")]


def start_server(args, tmp: str) -> tuple[subprocess.Popen, str]:
    """Start `llmsvc serve` on loopback ports; with --swap its metrics port goes in args.metrics_url."""
    port = free_port()
    extra = _lora_flags(args, tmp) if args.lora else []
    if args.swap:
        metrics_port = free_port()
        args.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        extra += ["--preemption-mode", "swap", "--swap-space", args.swap_space, "--metrics-port", str(metrics_port)]
    cmd = [sys.executable, "-m", "llmsvc", "serve"] + ([args.model] if args.model else []) + [
        "--host", "127.0.0.1", "--port", str(port), "--max-model-len", str(args.max_model_len),
        "--kv-cache-memory", args.kv_cache_memory, "--max-num-seqs", str(args.max_num_seqs),
        "--log-level", "WARNING", *extra, *args.serve_arg]
    proc = subprocess.Popen(cmd, env=dict(os.environ))
    target = f"127.0.0.1:{port}"
    wait_serving(target, 900, proc)
    return proc, target


def _header(swap: bool) -> str:
    cols = f"{'t_s':>7} {'rss_mib':>9} {'free_blk':>8} {'running':>7} {'waiting':>7}"
    if swap:
        cols += f" {'swapped':>7} {'swap_free':>9} {'swap_out':>8}"
    return cols + f" {'calls':>7} {'tokens':>8} {'errors':>6}"


def take_sample(args, traffic: Traffic, pid: int | None, t0: float, swap: bool) -> dict:
    """One timeline point, printed as a table row."""
    info = traffic.stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
    with traffic.lock:
        calls, toks = sum(traffic.by_code.values()), traffic.tokens
        errors = sum(v for k, v in traffic.by_code.items() if k in BAD_CODES)
    s = dict(t=round(time.monotonic() - t0, 1), rss=rss_bytes(pid) if pid else 0,
             free=info.num_free_kv_blocks, running=info.num_running, waiting=info.num_waiting)
    row = f"{s['t']:>7.1f} {s['rss'] / 2**20:>9.1f} {s['free']:>8} {s['running']:>7} {s['waiting']:>7}"
    if swap:
        counters = swap_counters(args.metrics_url)
        s.update(swapped=info.num_swapped, swap_free=info.num_free_swap_blocks,
                 swap_outs=counters["swap_outs"] if counters else None)
        row += f" {s['swapped']:>7} {s['swap_free']:>9} {str(s['swap_outs']):>8}"
    print(f"{row} {calls:>7} {toks:>8} {errors:>6}", flush=True)
    return s


def run_traffic(args, traffic: Traffic, pid: int | None, swap: bool) -> list[dict]:
    """Run the client threads for --minutes, sampling every --interval seconds; stop and join them."""
    threads = [threading.Thread(target=traffic.worker, args=(w,), daemon=True) for w in range(args.concurrency)]
    if args.lora:
        threads.append(threading.Thread(target=lora_churn, args=(traffic, args.lora_path), daemon=True))
    if traffic.swap:
        threads.append(threading.Thread(target=traffic.watch_swapped, daemon=True))
    samples = []
    t0 = time.monotonic()
    for t in threads:
        t.start()
    end = t0 + args.minutes * 60
    while True:
        samples.append(take_sample(args, traffic, pid, t0, swap))
        if time.monotonic() >= end:
            break
        time.sleep(max(0.0, min(args.interval, end - time.monotonic())))
    traffic.stop.set()
    for t in threads:
        t.join(330)
    return samples


def summarize(args, target: str, traffic: Traffic, final: pb.GetServerInfoResponse, samples: list[dict],
              rss_end: int) -> dict:
    rss = [x["rss"] for x in samples] + [rss_end]
    steady = rss[len(rss) // 4:] if len(rss) >= 8 else rss  # after warm-up (allocator, caches)
    summary = dict(
        target=target, minutes=args.minutes, concurrency=args.concurrency, executor=final.executor,
        num_kv_blocks=final.num_kv_blocks, free_kv_blocks_end=final.num_free_kv_blocks,
        all_blocks_free_end=final.num_free_kv_blocks == final.num_kv_blocks,
        running_end=final.num_running, waiting_end=final.num_waiting,
        rss_start_mib=round(rss[0] / 2**20, 1), rss_end_mib=round(rss_end / 2**20, 1),
        rss_max_mib=round(max(rss) / 2**20, 1),
        rss_growth_after_warmup_mib=round((rss_end - steady[0]) / 2**20, 1),
        calls=sum(traffic.by_code.values()), tokens_received=traffic.tokens,
        calls_by_code=dict(traffic.by_code), calls_by_kind_and_code=dict(sorted(traffic.codes.items())),
        min_free_kv_blocks=min(x["free"] for x in samples), samples=len(samples))
    if final.num_swap_blocks:  # a swap space: its pool must end as free as the KV cache
        counters = swap_counters(args.metrics_url) or {}
        outs, ins = counters.get("swap_outs"), counters.get("swap_ins")
        summary.update(
            preemption_mode=final.preemption_mode, num_swap_blocks=final.num_swap_blocks,
            free_swap_blocks_end=final.num_free_swap_blocks,
            all_swap_blocks_free_end=final.num_free_swap_blocks == final.num_swap_blocks,
            swapped_end=final.num_swapped, swap_outs=outs, swap_ins=ins,
            ended_while_swapped=None if outs is None else outs - ins - final.num_swapped,
            max_swapped=max(x.get("swapped", 0) for x in samples),
            min_free_swap_blocks=min(x.get("swap_free", final.num_swap_blocks) for x in samples),
            strikes=dict(traffic.strikes), swapped_seen_by_kind_and_finish=dict(sorted(traffic.swapped_seen.items())))
    return summary


def problems(args, summary: dict) -> list[str]:
    """Why the run failed (empty: it passed)."""
    out = []
    if not summary["all_blocks_free_end"]:
        out.append(f"{summary['num_kv_blocks'] - summary['free_kv_blocks_end']} KV blocks still held")
    if summary["running_end"] or summary["waiting_end"]:
        out.append(f"{summary['running_end']} running, {summary['waiting_end']} waiting at the end")
    bad = {k: v for k, v in summary["calls_by_code"].items() if k in BAD_CODES}
    if bad:
        out.append(f"calls failed with {bad}")
    if summary.get("num_swap_blocks"):
        if not summary["all_swap_blocks_free_end"]:
            out.append(f"{summary['num_swap_blocks'] - summary['free_swap_blocks_end']} swap-space blocks still held")
        if summary["swapped_end"]:
            out.append(f"{summary['swapped_end']} requests still swapped out")
    if args.swap:
        if summary.get("swap_outs") is None:
            out.append("swap-outs unknown (no swap space, or no /metrics: --metrics-url)")
        elif summary["swap_outs"] == 0:
            out.append("no request was swapped out, so the run proved nothing about swap: lower --kv-cache-memory "
                       "or raise --max-tokens / --concurrency")
        elif summary["ended_while_swapped"] == 0:
            out.append("no request was ended while swapped out, so the run proved nothing about aborts of swapped "
                       "requests: run longer")
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--server", help="HOST:PORT of a running server (default: start one)")
    p.add_argument("--server-pid", type=int, help="pid of --server, for RSS sampling")
    p.add_argument("--metrics-url", help="/metrics of --server, for its swap counters")
    p.add_argument("--model", help="model for the started server (default: the default model)")
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--kv-cache-memory", help=f"small, so that requests get preempted (default {PLAIN_DEFAULTS[0]}; "
                   f"with --swap {SWAP_DEFAULTS[0]})")
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--serve-arg", action="append", default=[], help="extra `llmsvc serve` argument (repeat)")
    p.add_argument("--concurrency", type=int, default=6)
    p.add_argument("--max-tokens", type=int, help=f"per request, at most (default {PLAIN_DEFAULTS[1]}; "
                   f"with --swap {SWAP_DEFAULTS[1]})")
    p.add_argument("--interval", type=float, default=5.0, help="seconds between samples")
    p.add_argument("--idle-timeout", type=float, default=120.0, help="seconds the server gets to go idle at the end")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="also write the summary here")
    p.add_argument("--lora", action="store_true", help="the started server serves LoRA adapters (see above)")
    p.add_argument("--swap", action="store_true", help="swap-preemption and aborts of swapped requests (see above)")
    p.add_argument("--swap-space", help=f"the started server's swap space (implies --swap; default {SWAP_SPACE})")
    args = p.parse_args(argv)
    if args.lora and args.server:
        p.error("--lora starts its own server")
    args.swap = args.swap or args.swap_space is not None
    if args.swap and args.server and not args.metrics_url:
        p.error("--swap with --server needs --metrics-url (the swap-out count)")
    kv, max_tokens = SWAP_DEFAULTS if args.swap else PLAIN_DEFAULTS
    args.kv_cache_memory = args.kv_cache_memory or kv
    args.max_tokens = args.max_tokens or max_tokens
    args.swap_space = args.swap_space or SWAP_SPACE
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    proc = None
    tmp = tempfile.mkdtemp(prefix="llmsvc-soak-")
    if args.server:
        target, pid = args.server, args.server_pid
    else:
        proc, target = start_server(args, tmp)
        pid = proc.pid
    traffic = Traffic(target, args.seed, args.max_tokens, LORA_NAMES if args.lora else (), swap=args.swap)
    try:
        info0 = traffic.stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
        swap = info0.num_swap_blocks > 0
        print(f"soak: {target} executor={info0.executor} device={info0.device} kv_blocks={info0.num_kv_blocks} "
              + (f"swap_blocks={info0.num_swap_blocks} preemption={info0.preemption_mode} " if swap else "")
              + f"for {args.minutes:g} min, {args.concurrency} clients", flush=True)
        print(_header(swap), flush=True)
        samples = run_traffic(args, traffic, pid, swap)
        final = wait_idle(traffic.stub, args.idle_timeout)
        summary = summarize(args, target, traffic, final, samples, rss_bytes(pid) if pid else 0)
        print(json.dumps(summary, indent=2), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(summary, timeline=samples), f, indent=2)
        failed = problems(args, summary)
        for line in failed:
            print(f"soak: FAILED: {line}", file=sys.stderr, flush=True)
        return 1 if failed else 0
    finally:
        traffic.stop.set()
        traffic.channel.close()
        if proc is not None:
            stop_server(proc, 60)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
