"""The parts of a bench run beside and after its main runs: our engine quantized as another
system in the turns (--compare-quantization), the structured-output run, the same workload again
with one feature changed (prefix caching off, recompute preemption), the FLOP ceiling and memory
floor, and the rate / concurrency sweeps. Each reads and extends the
workload's result dict `res`; `ours` is llmsvc's own main result (gRPC, else offline)."""
from __future__ import annotations

import argparse


def quantized_systems(a, offline, serve) -> list:
    """--compare-quantization Q: our engine again with --quantization Q, one System per mode, to
    take turns with the runs as given (so --repeat and the idle check apply to both alike)."""
    from llmsvc.bench.repeat import System

    q = getattr(a, "compare_quantization", None)
    if not q:
        return []
    flags = argparse.Namespace(**{**vars(a), "quantization": q})
    out = []
    if a.mode in ("offline", "both"):
        out.append(System(f"offline_{q}", f"llmsvc offline, {q}", lambda: offline(flags=flags)[1]))
    if a.mode in ("serve", "both"):
        out.append(System(f"serve_{q}", f"llmsvc gRPC, {q}", lambda: serve(flags=flags)[1]))
    return out


def print_quantization_ratio(a, res: dict) -> None:
    """Output tok/s and TTFT p50 of the quantized runs against the runs as given (medians)."""
    q = getattr(a, "compare_quantization", None)
    for kind in ("offline", "serve"):
        if not q or f"{kind}_{q}" not in res:
            continue
        qs, base = res[f"{kind}_{q}"], res[kind]
        ratio = qs["output_tok_s"] / base["output_tok_s"] if base["output_tok_s"] else float("nan")
        t_q, t_base = qs["ttft_s"]["p50"], base["ttft_s"]["p50"]
        ttft = t_q / t_base if t_q is not None and t_base else float("nan")
        res.setdefault("quantization_ratio", {})[kind] = {"quantization": q, "output_tok_s": ratio, "ttft_p50": ttft}
        was = getattr(a, "quantization", "none")
        print(f"  {'offline' if kind == 'offline' else 'gRPC'} output tok/s with --quantization {q} / {was}: "
              f"{qs['output_tok_s']:.1f} / {base['output_tok_s']:.1f} = {ratio:.2f}x; TTFT p50 {ttft:.2f}x")


def _recompute_only(a):
    """The flags of `a` with preemption by recompute and no swap space (--compare-preemption)."""
    return argparse.Namespace(**{**vars(a), "swap_space": None, "preemption_mode": "recompute"})


def structured_run(a, res: dict, model_dir: str, offline, serve, tally) -> None:
    """The same workload with a JSON Schema on every request, and the schema's compile time.

    The constrained run is bracketed by the unconstrained one before it and another after it,
    and compared with their mean, so that load drifting on a shared machine biases neither."""
    from llmsvc.bench.structured import compile_seconds

    with open(a.json_schema) as f:
        schema = f.read()
    cold, warm = compile_seconds(model_dir, schema)
    res["json_schema"] = {"file": a.json_schema, "compile_s": cold, "cached_compile_s": warm}
    print(f"  JSON Schema {a.json_schema}: compiles in {1e3 * cold:.1f} ms (once per distinct schema; "
          f"{1e3 * warm:.3f} ms from the grammar cache)")
    for kind, run in (("offline", offline), ("serve", serve)):
        if kind not in res:
            continue
        tag = "offline" if kind == "offline" else "gRPC"
        _, s = run(json_schema=schema)
        res[f"{kind}_json_schema"] = s
        tally.report(f"llmsvc {tag}, JSON Schema", s)
        _, after = run()
        res[f"{kind}_after_json_schema"] = after
        tally.report(f"llmsvc {tag}, again", after)
        base = (res[kind]["output_tok_s"] + after["output_tok_s"]) / 2
        ratio = s["output_tok_s"] / base if base else float("nan")
        res["json_schema"][f"{kind}_ratio"] = ratio
        print(f"  output tok/s with the schema / without (mean of the runs before and after): "
              f"{s['output_tok_s']:.1f} / {base:.1f} = {ratio:.2f}x ({_tokens(s)} vs {_tokens(after)} "
              "tokens: a complete document ends its request)")


def _tokens(s: dict) -> int:
    return round(s["output_tok_s"] * s["wall_s"])


def print_grpc_ratio(res: dict) -> None:
    """--mode both: gRPC's output tok/s over the in-process engine's, and what streaming costs."""
    res["grpc_ratio"] = res["serve"]["output_tok_s"] / res["offline"]["output_tok_s"]
    res["grpc_cost"] = 1 - res["grpc_ratio"]
    print(f"  gRPC / in-process output tok/s: {res['grpc_ratio']:.3f}x "
          f"(gRPC streaming cost vs offline: {100 * res['grpc_cost']:.1f}%)")


def compare_again(a, res: dict, ours: dict, offline, serve, tally) -> None:
    """--compare-prefix-caching and --compare-preemption: the same mode run again with it changed."""
    if a.compare_prefix_caching:  # the same mode again, prefix caching off
        kind, run = ("offline", offline) if a.mode == "offline" else ("serve", serve)
        _, off = run(prefix_caching=False)
        res[f"{kind}_no_prefix_caching"] = off
        on = ours["prefill_tok_s"]
        res["prefix_caching_prefill_speedup"] = on / off["prefill_tok_s"] if off["prefill_tok_s"] else float("nan")
        tally.report(f"llmsvc {'offline' if kind == 'offline' else 'gRPC'}, no prefix cache", off)
        print(f"  prefill throughput with / without prefix caching: {on:.0f} / {off['prefill_tok_s']:.0f} "
              f"tok/s = {res['prefix_caching_prefill_speedup']:.2f}x")
    if a.compare_preemption:  # the same mode again, preempting by recompute
        kind, run = ("offline", offline) if a.mode == "offline" else ("serve", serve)
        _, rec = run(flags=_recompute_only(a))
        res[f"{kind}_recompute_preemption"] = rec
        res["swap_output_speedup"] = ours["output_tok_s"] / rec["output_tok_s"] if rec["output_tok_s"] else float("nan")
        tally.report(f"llmsvc {'offline' if kind == 'offline' else 'gRPC'}, recompute preemption", rec)
        print(f"  output throughput with swap / recompute preemption: {ours['output_tok_s']:.1f} / "
              f"{rec['output_tok_s']:.1f} tok/s = {res['swap_output_speedup']:.2f}x")


def print_ceiling(a, w, res: dict, ours: dict, model_dir: str) -> None:
    """--ceiling: the workload's GEMM FLOP ceiling, its memory floor and a decode step against it."""
    from llmsvc.bench.ceiling import (arithmetic_dtype, ceiling, decode_step, gemm_flops,
                                      kv_bytes_per_token, memory_floor, param_counts, read_bandwidth)

    counts = param_counts(model_dir)
    arith = arithmetic_dtype(a.dtype)
    c = ceiling(w, counts, gemm_flops(arith))
    c["fraction"] = ours["output_tok_s"] / c["output_tok_s"]
    c["gemm_dtype"] = arith
    res["ceiling"] = c
    label = a.dtype if arith == a.dtype else f"{arith}, as {a.dtype} computes on this CPU,"
    print(f"  ceiling ({label} GEMM {c['gemm_gflops']:.0f} GFLOP/s, {c['workload_tflop']:.2f} TFLOP): "
          f"{c['output_tok_s']:.0f} out tok/s; llmsvc reaches {100 * c['fraction']:.0f}%")
    nb = 4 if a.dtype == "float32" else 2
    bw = read_bandwidth()
    d = decode_step(a.model, a.dtype, bw, quantization=getattr(a, "quantization", "none"))  # None on a GPU
    # quantized weights are read as stored: the decode step's engine counted them
    m = memory_floor(w, counts, kv_bytes_per_token(model_dir, nb), nb, bw, weight_bytes=d and d["weight_bytes"])
    res["memory_floor"] = m
    print(f"  memory floor ({m['weight_read_gb']:.1f} GB of weights + {m['kv_read_gb']:.1f} GB of K/V "
          f"at {m['read_gb_s']:.1f} GB/s): {m['output_tok_s']:.0f} out tok/s; the K/V reads alone take "
          f"{m['kv_seconds']:.1f} s, outside the FLOP ceiling")
    if d:
        res["decode_step"] = d
        print(f"  {d['seqs']}-seq decode step: {d['step_ms']:.1f} ms = {d['ratio']:.2f} x its memory floor")


def run_sweeps(a, res: dict, serve, tally) -> None:
    """--sweep-rate / --sweep-concurrency: the gRPC run again at each rate or concurrency."""
    for kind, values in (("rate", a.sweep_rate), ("concurrency", a.sweep_concurrency)):
        if values:
            sweep = res.setdefault(f"sweep_{kind}", {})
            for v in [float(x) for x in values.split(",")]:
                _, s = serve(**{kind: v if kind == "rate" else int(v)})
                sweep[str(v)] = s
                tally.report(f"{kind}={v:g}", s)
