"""Quality of `--quantization int8` against bf16 on a real model (default: SmolLM2-135M-Instruct).

The prompts are W1's (llmsvc/bench/workloads.json: 64 requests of 128 token ids drawn from the
ordinary vocabulary); each runs greedy for 128 tokens (ignore_eos) under bf16 and under int8
(bf16 compute, int8 weights and activations). Printed:

  free-running agreement   the share of the 64 x 128 positions where int8's greedy token equals
                           bf16's (a divergence makes the rest of that sequence differ too),
                           and the mean length of the common prefix
  teacher-forced agreement the share of positions where int8, fed the prompt and bf16's
                           continuation, ranks bf16's token first (no divergence cascade)
  mean log-probability     of bf16's greedy continuation, per token, under int8 and under bf16
                           itself (both through prompt_logprobs on prompt + continuation)

python -m benchmarks.int8_quality [--model DIR_OR_GGUF] [--requests 64] [--output-len 128]
                                  [--candidate int8|fp32]

--candidate fp32 measures float32 (no quantization) against bf16 the same way: how far two
float precisions already drift apart on these prompts.
"""
from __future__ import annotations

import argparse
import time


def _engine(model, quantization: str, dtype: str):
    from llmsvc import LLM

    return LLM(model=model, dtype=dtype, quantization=quantization, max_num_seqs=64,
               max_num_batched_tokens=1024, kv_cache_memory="2GiB")


def _greedy(llm, prompts, output_len: int) -> list[list[int]]:
    from llmsvc import SamplingParams

    sp = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sp, use_tqdm=False)]


def _score(llm, prompts, conts) -> tuple[float, float]:
    """(mean log-probability of each continuation token, share of them ranked first) under llm."""
    from llmsvc import SamplingParams

    sp = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    outs = llm.generate([p + c for p, c in zip(prompts, conts)], sp, use_tqdm=False)
    total = top1 = n = 0
    for p, c, o in zip(prompts, conts, outs):
        for pos, tok in enumerate(c, start=len(p)):
            lp = o.prompt_logprobs[pos][tok]
            total += lp.logprob
            top1 += lp.rank == 1
            n += 1
    return total / n, top1 / n


# what is compared with bf16: (quantization, dtype)
CANDIDATES = {"int8": ("int8", "bfloat16"), "fp32": ("none", "float32")}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="HF directory or .gguf (default: the default model)")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--candidate", default="int8", choices=list(CANDIDATES))
    a = ap.parse_args(argv)
    from llmsvc.bench.workloads import build_prompts, get_workload, ordinary_vocab

    w = get_workload("W1")
    results = {}
    for name, (quant, dtype) in (("bf16", ("none", "bfloat16")), (a.candidate, CANDIDATES[a.candidate])):
        t0 = time.perf_counter()
        llm = _engine(a.model, quant, dtype)
        prompts = build_prompts(w, ordinary_vocab(llm.get_tokenizer()))[:a.requests]
        results[name] = {"greedy": _greedy(llm, prompts, a.output_len), "llm": llm}
        print(f"{name}: generated in {time.perf_counter() - t0:.1f} s", flush=True)
    ref, cand = results["bf16"]["greedy"], results[a.candidate]["greedy"]
    same = sum(x == y for r, q in zip(ref, cand) for x, y in zip(r, q))
    prefix = [next((i for i, (x, y) in enumerate(zip(r, q)) if x != y), len(r)) for r, q in zip(ref, cand)]
    total = sum(len(r) for r in ref)
    print(f"prompts: {len(prompts)} x {w.input_len} tokens (W1), {a.output_len} greedy tokens each")
    print(f"{a.candidate} against bf16, free-running agreement: {same / total:.4f} ({same}/{total}); mean common prefix "
          f"{sum(prefix) / len(prefix):.1f} tokens; {sum(p == a.output_len for p in prefix)} sequences identical")
    for name, r in results.items():
        lp, top1 = _score(r["llm"], prompts, ref)
        print(f"bf16 greedy continuation under {name}: mean log-prob {lp:.4f} per token, teacher-forced "
              f"top-1 agreement {top1:.4f}")
    for r in results.values():
        r["llm"].shutdown()


if __name__ == "__main__":
    main()
