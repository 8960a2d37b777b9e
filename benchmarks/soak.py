"""Soak: N minutes of mixed, partly abusive traffic against one llmsvc server, watching for leaks.

    python -m benchmarks.soak                      # starts `llmsvc serve` (default model), 10 minutes
    python -m benchmarks.soak --minutes 2 --model /path/to/tiny-model-dir
    python -m benchmarks.soak --server 127.0.0.1:50051 --server-pid 1234
    python -m benchmarks.soak --lora --minutes 3   # also LoRA traffic and adapter load/unload churn

Traffic (each client thread draws one per request): streamed and unary completions, n=2, stop
strings, chat, client cancels mid-stream, Abort RPCs, short deadlines, slow readers, bad requests.
Every --interval seconds it samples the RSS of the server process and its children and the KV free
block count (GetServerInfo) and prints a table row. With --lora the started server serves a random
adapter ("soak") and may hold a second ("churn") that a thread loads and unloads every ~2 s through
AdminService while requests name either, or none, or an unknown one; at the end it waits for the server to go idle
and prints a JSON summary: start/end/max RSS, free blocks at the end == total, calls by status code.
Exit code 0 when nothing leaked (all blocks free, nothing running/waiting, no INTERNAL/UNKNOWN).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import grpc

from llmsvc.bench.server_proc import free_port, stop_server, wait_serving
from llmsvc.v1 import llmsvc_pb2 as pb
from llmsvc.v1 import llmsvc_pb2_grpc as pb_grpc

ST = pb.StoppingCriteria
WORDS = ("the quick brown fox jumps over a lazy dog while servers stream tokens to many "
         "clients under load and some of them leave early").split()
KINDS = ("stream", "unary", "n2", "stop", "chat", "cancel", "abort", "deadline", "slow", "bad")


def _proc_rss_bytes(pid: int) -> int:
    """Linux /proc fallback when psutil is not installed."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/statm") as f:
                total += int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
            for t in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{t}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except (OSError, ValueError):
            pass
    return total


def rss_bytes(pid: int) -> int:
    """Resident memory of `pid` and all its descendants (0 if it is gone)."""
    try:
        import psutil
    except ImportError:
        return _proc_rss_bytes(pid)
    try:
        p = psutil.Process(pid)
        procs = [p] + p.children(recursive=True)
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for q in procs:
        try:
            total += q.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


class Traffic:
    def __init__(self, target: str, seed: int, max_tokens: int, lora_names: tuple = ()) -> None:
        self.channel = grpc.insecure_channel(target)
        self.stub = pb_grpc.LlmServiceStub(self.channel)
        self.seed, self.max_tokens = seed, max_tokens
        self.lora_names = lora_names  # adapters requests may name (None: the base model)
        self.codes: collections.Counter = collections.Counter()  # "KIND:CODE"
        self.by_code: collections.Counter = collections.Counter()
        self.tokens = 0
        self.lock = threading.Lock()
        self.stop = threading.Event()

    def _count(self, kind: str, code: str, tokens: int = 0) -> None:
        with self.lock:
            self.codes[f"{kind}:{code}"] += 1
            self.by_code[code] += 1
            self.tokens += tokens

    def _request(self, rng: random.Random, rid: str, kind: str) -> pb.GenerateRequest:
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 60)))
        r = pb.GenerateRequest(request_id=rid, text=text, stream=kind != "unary",
                               sampling=pb.SamplingParams(temperature=rng.choice([0.0, 0.7, 1.0]),
                                                          top_p=rng.choice([1.0, 0.9]), seed=rng.randrange(1 << 30)),
                               stopping=ST(max_tokens=rng.randint(1, self.max_tokens), ignore_eos=rng.random() < 0.5))
        if self.lora_names:
            name = rng.choice(self.lora_names)
            if name is not None:
                r.lora_name = name
        if kind == "n2":
            r.sampling.n = 2
        elif kind == "stop":
            r.stopping.stop.extend(rng.sample(WORDS, 3) + ["."])
        elif kind == "chat":
            r.ClearField("text")
            r.chat.messages.add(role="user", content=text)
        elif kind == "bad":
            bad = rng.randrange(4)
            if bad == 0:
                r.sampling.top_p = 0.0
            elif bad == 1:
                r.stopping.max_tokens = 10 ** 7
            elif bad == 2:
                r.stopping.stop.append("")
            else:
                r.ClearField("text")
        return r

    def one(self, rng: random.Random, i: int, worker: int) -> None:
        kind = rng.choice(KINDS)
        rid = f"soak-{worker}-{i}"
        req = self._request(rng, rid, kind)
        n_tok = 0
        try:
            timeout = rng.uniform(0.05, 1.5) if kind == "deadline" else 300
            call = self.stub.Generate(req, timeout=timeout)
            for k, m in enumerate(call):
                n_tok += len(m.token_ids)
                if kind == "cancel" and k == 1:
                    call.cancel()
                    break
                if kind == "abort" and k == 1:
                    self.stub.Abort(pb.AbortRequest(request_ids=[rid, f"unknown-{rid}"]), timeout=30)
                if kind == "slow":
                    time.sleep(0.2)
            self._count(kind, "CANCELLED" if kind == "cancel" else "OK", n_tok)
        except grpc.RpcError as e:
            self._count(kind, e.code().name, n_tok)

    def worker(self, w: int) -> None:
        rng = random.Random(self.seed * 1000 + w)
        i = 0
        while not self.stop.is_set():
            self.one(rng, i, w)
            i += 1


LORA_NAMES = (None, "soak", "churn", "never-loaded")
ADMIN_TOKEN = "soak-admin"


def lora_churn(traffic: Traffic, path: str) -> None:
    """Load and unload the adapter "churn" every ~2 s (a refused unload: it is in use)."""
    admin = pb_grpc.AdminServiceStub(traffic.channel)
    md = (("authorization", f"Bearer {ADMIN_TOKEN}"),)
    loaded = False
    while not traffic.stop.wait(2.0):
        try:
            if loaded:
                admin.UnloadLoraAdapter(pb.UnloadLoraAdapterRequest(lora_name="churn"), metadata=md, timeout=60)
            else:
                admin.LoadLoraAdapter(pb.LoadLoraAdapterRequest(lora_name="churn", lora_path=path), metadata=md,
                                      timeout=60)
            loaded = not loaded
            traffic._count("unload" if not loaded else "load", "OK")
        except grpc.RpcError as e:
            traffic._count("unload" if loaded else "load", e.code().name)


def start_server(args, tmp: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    lora = []
    if args.lora:
        from benchmarks.lora import write_random_adapter
        from llmsvc.config import ModelConfig
        from llmsvc.models.resolve import resolve_model_config

        args.lora_path = write_random_adapter(resolve_model_config(ModelConfig(model=args.model)),
                                              os.path.join(tmp, "adapter"), 8)
        with open(os.path.join(tmp, "admin-tokens"), "w") as f:
            f.write(ADMIN_TOKEN + "\n")
        lora = ["--lora-modules", f"soak={args.lora_path}", "--max-loras", "2", "--max-lora-rank", "8",
                "--admin-token-file", os.path.join(tmp, "admin-tokens")]
    cmd = [sys.executable, "-m", "llmsvc", "serve"] + ([args.model] if args.model else []) + [
        "--host", "127.0.0.1", "--port", str(port), "--max-model-len", str(args.max_model_len),
        "--kv-cache-memory", args.kv_cache_memory, "--max-num-seqs", str(args.max_num_seqs),
        "--log-level", "WARNING", *lora, *args.serve_arg]
    proc = subprocess.Popen(cmd, env=dict(os.environ))
    target = f"127.0.0.1:{port}"
    wait_serving(target, 900, proc)
    return proc, target


def wait_idle(stub, timeout: float = 120.0) -> pb.GetServerInfoResponse:
    end = time.monotonic() + timeout
    while True:
        info = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
        idle = info.num_free_kv_blocks == info.num_kv_blocks and info.num_running == 0 and info.num_waiting == 0
        if idle or time.monotonic() > end:
            return info
        time.sleep(0.2)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--server", help="HOST:PORT of a running server (default: start one)")
    p.add_argument("--server-pid", type=int, help="pid of --server, for RSS sampling")
    p.add_argument("--model", help="model for the started server (default: the default model)")
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--kv-cache-memory", default="48MiB", help="small, so that requests get preempted")
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--serve-arg", action="append", default=[], help="extra `llmsvc serve` argument (repeat)")
    p.add_argument("--concurrency", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--interval", type=float, default=5.0, help="seconds between samples")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="also write the summary here")
    p.add_argument("--lora", action="store_true", help="the started server serves LoRA adapters (see above)")
    args = p.parse_args(argv)
    if args.lora and args.server:
        p.error("--lora starts its own server")

    proc = None
    tmp = tempfile.mkdtemp(prefix="llmsvc-soak-")
    if args.server:
        target, pid = args.server, args.server_pid
    else:
        proc, target = start_server(args, tmp)
        pid = proc.pid
    traffic = Traffic(target, args.seed, args.max_tokens, LORA_NAMES if args.lora else ())
    stub = traffic.stub
    samples = []
    try:
        info0 = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
        print(f"soak: {target} executor={info0.executor} device={info0.device} kv_blocks={info0.num_kv_blocks} "
              f"for {args.minutes:g} min, {args.concurrency} clients", flush=True)
        print(f"{'t_s':>7} {'rss_mib':>9} {'free_blk':>8} {'running':>7} {'waiting':>7} {'calls':>7} "
              f"{'tokens':>8} {'errors':>6}", flush=True)
        threads = [threading.Thread(target=traffic.worker, args=(w,), daemon=True) for w in range(args.concurrency)]
        if args.lora:
            threads.append(threading.Thread(target=lora_churn, args=(traffic, args.lora_path), daemon=True))
        t0 = time.monotonic()
        for t in threads:
            t.start()
        end = t0 + args.minutes * 60
        while True:
            info = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
            with traffic.lock:
                calls, toks = sum(traffic.by_code.values()), traffic.tokens
                errors = sum(v for k, v in traffic.by_code.items() if k in ("INTERNAL", "UNKNOWN", "UNAVAILABLE"))
            s = dict(t=round(time.monotonic() - t0, 1), rss=rss_bytes(pid) if pid else 0,
                     free=info.num_free_kv_blocks, running=info.num_running, waiting=info.num_waiting)
            samples.append(s)
            print(f"{s['t']:>7.1f} {s['rss'] / 2**20:>9.1f} {s['free']:>8} {s['running']:>7} {s['waiting']:>7} "
                  f"{calls:>7} {toks:>8} {errors:>6}", flush=True)
            if time.monotonic() >= end:
                break
            time.sleep(max(0.0, min(args.interval, end - time.monotonic())))
        traffic.stop.set()
        for t in threads:
            t.join(330)
        final = wait_idle(stub)
        rss_end = rss_bytes(pid) if pid else 0
        rss = [x["rss"] for x in samples] + [rss_end]
        bad_codes = {k: v for k, v in traffic.by_code.items() if k in ("INTERNAL", "UNKNOWN", "UNAVAILABLE")}
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
        print(json.dumps(summary, indent=2), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(summary, timeline=samples), f, indent=2)
        ok = summary["all_blocks_free_end"] and not final.num_running and not final.num_waiting and not bad_codes
        return 0 if ok else 1
    finally:
        traffic.stop.set()
        traffic.channel.close()
        if proc is not None:
            stop_server(proc, 60)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
