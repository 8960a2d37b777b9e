"""Swap-space benchmarks, offline, each comparing two engines on one workload in one run.

preemption: long prompts against a KV cache too small for them all (the workload P1 of
  workloads.json), preempted by recompute and then by swap; prints output tok/s, prompt tokens
  computed, preemptions and swaps, and the mean end-to-end latency of the requests that were
  preempted; the greedy tokens of both runs must be equal.
multiturn: conversations that return turn after turn over a long prefix of their own (MT1),
  against a KV cache that holds a fraction of those prefixes, without and with the host tier of
  the prefix cache; prints prompt tokens computed and tok/s; the greedy tokens must be equal.

    python -m llmsvc.bench.swap preemption --dtype bfloat16 --kv-cache-memory 24MiB --swap-space 256MiB
    python -m llmsvc.bench.swap multiturn --conversations 8 --turns 4 --prefix-len 512
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time

from llmsvc.bench.workloads import get_workload


def _engine(a, **kw):
    from llmsvc import LLM

    return LLM(model=a.model, dtype=a.dtype, kv_cache_memory=a.kv_cache_memory,
               max_num_batched_tokens=a.max_num_batched_tokens,
               enable_prefix_caching=not getattr(a, "no_prefix_caching", False), **kw)


def _prompts(num: int, length: int, seed: int, vocab: int) -> list[list[int]]:
    return [[random.Random(seed + i).randrange(10, vocab) for _ in range(length)] for i in range(num)]


def _run(llm, prompts, max_tokens: int) -> dict:
    from llmsvc import SamplingParams

    before = llm.llm_engine.get_stats()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                        use_tqdm=False)
    seconds = time.perf_counter() - t0
    st = llm.llm_engine.get_stats()
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    preempted = [o.metrics for o in outs if o.metrics is not None and o.metrics.num_preemptions]
    e2e = [m.finished_time - m.arrival_time for m in preempted if m.finished_time]
    return {"seconds": seconds, "output_tok_s": n_out / seconds,
            "prompt_tokens_computed": st.prompt_tokens_total - before.prompt_tokens_total,
            "preemptions": st.num_preemptions - before.num_preemptions,
            "swap_outs": st.extra.get("swap_outs", 0) - before.extra.get("swap_outs", 0),
            "host_tier_hits": st.extra.get("host_tier_hits", 0) - before.extra.get("host_tier_hits", 0),
            "preempted_requests": len(preempted),
            "preempted_e2e_mean_s": sum(e2e) / len(e2e) if e2e else 0.0,
            "tokens": [o.outputs[0].token_ids for o in outs]}


def preemption(a) -> dict:
    w = get_workload(a.workload)
    results = {}
    for mode in ("recompute", "swap"):
        llm = _engine(a, preemption_mode=mode, swap_space=a.swap_space if mode == "swap" else None)
        try:
            vocab = llm.get_tokenizer().vocab_size
            prompts = _prompts(a.num_requests or w.num_requests, a.input_len or w.input_len, w.seed, vocab)
            results[mode] = _run(llm, prompts, a.output_len or w.output_len)
        finally:
            llm.shutdown()
    return results


def multiturn(a) -> dict:
    results = {}
    for label, swap in (("no host tier", None), ("host tier", a.swap_space)):
        llm = _engine(a, swap_space=swap, preemption_mode="recompute")
        try:
            vocab = llm.get_tokenizer().vocab_size
            rng = random.Random(a.seed)
            history = _prompts(a.conversations, a.prefix_len, a.seed, vocab)
            total = {"seconds": 0.0, "prompt_tokens_computed": 0, "prompt_tokens": 0, "host_tier_hits": 0,
                     "tokens": []}
            for _ in range(a.turns):
                for h in history:  # the user's next message
                    h.extend(rng.randrange(10, vocab) for _ in range(a.turn_len))
                total["prompt_tokens"] += sum(len(h) for h in history)
                r = _run(llm, [list(h) for h in history], a.output_len)
                for h, toks in zip(history, r["tokens"]):
                    h.extend(toks)
                for k in ("seconds", "prompt_tokens_computed", "host_tier_hits", "tokens"):
                    total[k] += r[k]
            results[label] = total
        finally:
            llm.shutdown()
    return results


def _print(results: dict) -> bool:
    same = len({json.dumps(r["tokens"]) for r in results.values()}) == 1
    for label, r in results.items():
        shown = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items() if k != "tokens"}
        print(f"{label:>14}: {shown}")
    print("greedy tokens identical:", same)
    return same


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m llmsvc.bench.swap", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("which", choices=["preemption", "multiturn"])
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--kv-cache-memory", default="24MiB", help="small, so that the workload overflows it")
    p.add_argument("--swap-space", default="512MiB")
    p.add_argument("--max-num-batched-tokens", type=int, default=1024)
    p.add_argument("--workload", default="PR1", help="preemption: the workload of workloads.json")
    p.add_argument("--num-requests", type=int, default=None)
    p.add_argument("--input-len", type=int, default=None)
    p.add_argument("--output-len", type=int, default=None)
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--prefix-len", type=int, default=512, help="multiturn: each conversation's own first prompt")
    p.add_argument("--turn-len", type=int, default=32, help="multiturn: tokens the user adds each turn")
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="preemption: both engines without prefix caching, so a recomputed request finds none "
                        "of its blocks again (the recompute of engines without a prefix cache)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the results here")
    a = p.parse_args(argv)
    if a.which == "multiturn" and a.no_prefix_caching:
        p.error("--no-prefix-caching: the host tier is a tier of the prefix cache (multiturn needs it)")
    if a.which == "multiturn" and a.output_len is None:
        a.output_len = 16
    results = preemption(a) if a.which == "preemption" else multiturn(a)
    same = _print(results)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({k: {x: y for x, y in r.items() if x != "tokens"} for k, r in results.items()}, f, indent=2)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
