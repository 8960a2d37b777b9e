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
                                  [--candidate int8|fp32] [--prompts w1|chat]

--prompts chat takes CHAT_PROMPTS instead (natural questions, each one user turn through the
model's chat template); their greedy answers stop at the end of turn, as a chat client's do.
Random-token prompts leave the model few close calls; natural text gives it more.

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


CHAT_PROMPTS = (
    "What is the capital of France?", "Write a haiku about the sea.", "Explain photosynthesis to a child.",
    "How do I reverse a list in Python?", "Give me three tips for better sleep.", "What is 17 times 23?",
    "Translate 'good morning' into Spanish.", "Who wrote Romeo and Juliet?", "Summarize the plot of Cinderella.",
    "What causes rain?", "Name three primary colors.", "Why is the sky blue?", "Write a short poem about autumn.",
    "What is a black hole?", "How many legs does a spider have?", "Suggest a name for a pet cat.",
    "What are the benefits of exercise?", "Describe a rainbow.", "How does a computer work?",
    "What is the largest ocean?", "Tell me a fun fact about elephants.", "What should I cook for dinner tonight?",
    "How do airplanes fly?", "What is the meaning of democracy?")


def _prompts(llm, kind: str) -> list[list[int]]:
    """Token ids: W1's prompts, or CHAT_PROMPTS as one user turn each through the chat template."""
    tok = llm.get_tokenizer()
    if kind == "w1":
        from llmsvc.bench.workloads import build_prompts, get_workload, ordinary_vocab

        return build_prompts(get_workload("W1"), ordinary_vocab(tok))
    out = []
    for q in CHAT_PROMPTS:
        ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


def _greedy(llm, prompts, output_len: int, ignore_eos: bool = True) -> list[list[int]]:
    from llmsvc import SamplingParams

    sp = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=ignore_eos)
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
    ap.add_argument("--prompts", default="w1", choices=["w1", "chat"])
    a = ap.parse_args(argv)
    results = {}
    for name, (quant, dtype) in (("bf16", ("none", "bfloat16")), (a.candidate, CANDIDATES[a.candidate])):
        t0 = time.perf_counter()
        llm = _engine(a.model, quant, dtype)
        prompts = _prompts(llm, a.prompts)[:a.requests]
        results[name] = {"greedy": _greedy(llm, prompts, a.output_len, a.prompts == "w1"), "llm": llm}
        print(f"{name}: generated in {time.perf_counter() - t0:.1f} s", flush=True)
    ref, cand = results["bf16"]["greedy"], results[a.candidate]["greedy"]
    same = sum(x == y for r, q in zip(ref, cand) for x, y in zip(r, q))
    prefix = [next((i for i, (x, y) in enumerate(zip(r, q)) if x != y), min(len(r), len(q))) for r, q in zip(ref, cand)]
    total = sum(len(r) for r in ref)
    lens = sorted({len(p) for p in prompts})
    print(f"prompts: {len(prompts)} ({a.prompts}) of {lens[0]}-{lens[-1]} tokens, up to {a.output_len} greedy tokens each "
          f"(bf16: {total} in all)")
    print(f"{a.candidate} against bf16, free-running agreement: {same / total:.4f} ({same}/{total}); mean common prefix "
          f"{sum(prefix) / len(prefix):.1f} tokens; {sum(r == q for r, q in zip(ref, cand))} sequences identical")
    for name, r in results.items():
        lp, top1 = _score(r["llm"], prompts, ref)
        print(f"bf16 greedy continuation under {name}: mean log-prob {lp:.4f} per token, teacher-forced "
              f"top-1 agreement {top1:.4f}")
    for r in results.values():
        r["llm"].shutdown()


if __name__ == "__main__":
    main()
