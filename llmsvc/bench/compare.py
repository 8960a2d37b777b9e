"""Our runs and the peers' (HF generate, vLLM) on one workload, taking turns `--repeat` times,
and the ratios between them, printed and kept in the results."""
from __future__ import annotations

import argparse
import contextlib

from llmsvc.bench.metrics import summarize
from llmsvc.bench.repeat import System, fmt_runs, median_run, ratio, summarize_runs
from llmsvc.bench.workloads import Workload

BASELINES = ("hf", "vllm")


def parse_baselines(value: str) -> list[str]:
    """`--baseline hf,vllm` (or one of them, or none) as a list; argparse reports a bad name."""
    names = [v.strip() for v in value.split(",") if v.strip() and v.strip() != "none"]
    bad = [n for n in names if n not in BASELINES]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown baseline {bad[0]!r}; choose from none, {', '.join(BASELINES)} "
                                         "(comma-separated for several)")
    return list(dict.fromkeys(names))


def peer_systems(a, w: Workload, prompts, offsets, model_dir: str, vllm) -> list[System]:
    """The peers asked for with --baseline, as systems to take turns with ours. vLLM serves a
    Poisson workload from its OpenAI server (our gRPC run's counterpart) and runs any other
    with its offline LLM.generate (the counterpart of our offline run)."""
    out = []
    if "hf" in a.baseline:
        def hf() -> dict:
            from llmsvc.bench.hf_baseline import run_hf

            return summarize(*run_hf(model_dir, prompts, w.output_len, a.dtype, a.hf_batch_size))
        out.append(System("hf", "HF transformers generate", hf))
    if "vllm" in a.baseline:
        if w.arrival == "poisson":
            def vllm_run() -> dict:
                return summarize(*vllm.run_serving(prompts, w.output_len, offsets, w.concurrency))
            out.append(System("vllm", "vLLM OpenAI server", vllm_run))
        else:
            def vllm_run() -> dict:
                recs, wall, note = vllm.run_offline(prompts, w.output_len)
                s = summarize(recs, wall)
                if note:
                    s["note"] = note
                return s
            out.append(System("vllm", "vLLM LLM.generate", vllm_run))
    return out


def record_runs(res: dict, systems: list[System], runs: dict[str, list[dict]]) -> None:
    """res[key]: the median run of each system; with several runs also res[key + "_runs"] (all
    of them, in order) and res["repeat"][key] (median, min, max of the headline figures)."""
    for s in systems:
        res[s.key] = median_run(runs[s.key])
        if len(runs[s.key]) > 1:
            res[f"{s.key}_runs"] = runs[s.key]
            res.setdefault("repeat", {})[s.key] = summarize_runs(runs[s.key])


def print_spreads(res: dict, systems: list[System]) -> None:
    for s in systems:
        if s.key in res.get("repeat", {}):
            tag = f"{s.label}, median of {res['repeat'][s.key]['output_tok_s']['n']}"
            print(f"  {tag:<32} {fmt_runs(res['repeat'][s.key])}")


def _stats(res: dict, key: str) -> dict:
    return res.get("repeat", {}).get(key) or summarize_runs([res[key]])


def ours_for(w: Workload, res: dict, peer: str) -> str:
    """Which of our runs a peer is compared with: vLLM's server with our gRPC run on a Poisson
    workload, vLLM's LLM.generate with our offline run otherwise (falling back to the run there is)."""
    # the HF ratio has always been taken against the gRPC run where there is one
    serve_first = peer == "hf" or w.arrival == "poisson"
    prefer = ("serve", "offline") if serve_first else ("offline", "serve")
    return next(k for k in prefer if k in res)


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def print_ratios(w: Workload, res: dict, baselines: list[str]) -> None:
    """Ours over each peer from the medians: output tok/s (above 1: we are faster) and TTFT p50
    / p99 (below 1: our first tokens come sooner)."""
    for peer in baselines:
        if peer not in res:
            continue
        ours_key = ours_for(w, res, peer)
        ours, theirs = _stats(res, ours_key), _stats(res, peer)
        r = {"ours": ours_key, **{f: ratio(ours, theirs, f) for f in ("output_tok_s", "ttft_p50_s", "ttft_p99_s")}}
        if peer == "hf":  # the HF peer's TTFT is its batch's end: only throughput compares
            res["ratio_vs_hf"] = r["output_tok_s"]
            print(f"  llmsvc / HF output tok/s: {_x(r['output_tok_s'])}")
            continue
        res[f"ratio_vs_{peer}"] = r
        tag = "gRPC" if ours_key == "serve" else "offline"
        print(f"  llmsvc {tag} / {peer}: output tok/s {_x(r['output_tok_s'])}  TTFT p50 {_x(r['ttft_p50_s'])}  "
              f"p99 {_x(r['ttft_p99_s'])} (medians; TTFT below 1x: "
              "ours comes sooner)" + (f"\n  note: {res[peer]['note']}" if res[peer].get("note") else ""))


def check_peer_args(a) -> str | None:
    """Why the peer flags cannot run (the message for exit code 2), or None. Imports vllm in
    --vllm-python's interpreter once, so a wrong path fails before anything is measured."""
    if a.repeat < 1:
        return f"--repeat {a.repeat}: must be at least 1"
    if "vllm" in a.baseline:
        from llmsvc.bench.vllm_peer import PeerError, check_interpreter

        try:
            a._vllm_version = check_interpreter(a.vllm_python)
        except PeerError as e:
            return str(e)
    elif a.vllm_python:
        return "--vllm-python is used only with --baseline vllm"
    return None


def vllm_peer(a, model_dir: str):
    """The vLLM children for this run (started on first use) as a context manager, entered as
    None without --baseline vllm. vLLM gets our KV cache budget: its CPU build would otherwise
    reserve most of the machine's memory."""
    if "vllm" not in a.baseline:
        return contextlib.nullcontext()
    from llmsvc.bench.vllm_peer import VllmPeer
    from llmsvc.config import CacheConfig, parse_memory

    kv = parse_memory(a.kv_cache_memory) if a.kv_cache_memory else CacheConfig.kv_cache_memory_bytes
    print(f"vLLM {getattr(a, '_vllm_version', '?')} from {a.vllm_python} (KV cache {kv / 2**30:.1f} GiB)")
    return VllmPeer(a.vllm_python, model_dir, a.dtype, kv_cache_bytes=kv)
