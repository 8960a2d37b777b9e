"""What prompt-lookup speculative decoding gains, offline, in one command:

    .venv/bin/python -m benchmarks.spec_decode [--dtype bfloat16] [--concurrency 1 4 16] \
        [--k 4] [--lookup 3 5] [--disable-by-batch-size N] [--repeats 2] [--max-tokens 192] [MODEL]

Four tasks on MODEL (default SmolLM2-135M-Instruct), chat-templated unless said:
  edit    rewrite a function of this repository with one name changed, greedy (the answer mostly
          copies the prompt: what prompt lookup is for);
  quote   repeat a paragraph of this repository's docs word for word, greedy;
  story   an open question, sampled (temperature 0.8, top-p 0.95, a seed per request): little to
          look up, so mostly what drafting and verifying wrong drafts cost;
  loop    128 random ordinary tokens, not chat-templated, greedy with EOS ignored, as the
          W1/W2 workloads run: a small model's output falls into a loop, which lookup drafts.
Per task and concurrency c (waves of c requests at once over the task's 4 prompts, cycled up to c
when c > 4), the same requests run without drafts and with `{"method": "ngram",
"num_speculative_tokens": k, "prompt_lookup_min": lo, "prompt_lookup_max": hi}` (plus
"disable_by_batch_size" when given), taking turns per repeat. Prints output tok/s (median,
min-max), the ratio, the draft acceptance rate and mean acceptance length, and whether every
output (greedy or seeded) was the same both ways.
"""
from __future__ import annotations

import argparse
import inspect
import os
import statistics
import time

TASKS = ("edit", "quote", "story", "loop")
STORIES = ("Write a short story about a lighthouse keeper who finds a message in a bottle.",
           "Describe a busy market in a small town on a Saturday morning.",
           "Explain to a child why the sky is blue.",
           "Write a letter from a cat to its owner about the new dog.")
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _paragraphs() -> list[str]:
    """Prose paragraphs (no code, tables or headings) of docs/design.md."""
    with open(os.path.join(_REPO, "docs", "design.md")) as f:
        blocks = [b.strip() for b in f.read().split("\n\n")]
    return [b.replace("\n", " ") for b in blocks
            if len(b) > 300 and not b.startswith(("#", "|", "```", "-", "    ", "1."))][:4]


def _functions() -> list[tuple[str, str, str]]:
    """(source, name to rename, new name) of a few small functions of this repository."""
    from llmsvc.core import block_pool, kv_cache_manager, scheduler, spec_decode
    picks = [(kv_cache_manager.KVCacheManager.free, "blocks", "block_ids"),
             (scheduler.Scheduler.finish_requests, "req", "request"),
             (spec_decode.NgramProposer.propose, "drafts", "proposal"),
             (block_pool.BlockPool.free_blocks, "block", "block_id")]
    return [(inspect.cleandoc(inspect.getsource(fn)), old, new) for fn, old, new in picks]


def build_requests(task: str, tokenizer, vocab: list[int], count: int = 4) -> list:
    """(prompt token ids, SamplingParams keywords) per request; chat prompts through the model's
    template."""
    if task == "loop":
        import random
        rng = random.Random(0)
        return [([rng.choice(vocab) for _ in range(128)], {"temperature": 0.0, "ignore_eos": True})
                for _ in range(count)]
    sampling = {"temperature": 0.0}
    if task == "story":
        texts = list(STORIES)
        sampling = {"temperature": 0.8, "top_p": 0.95}
    elif task == "edit":
        texts = [f"Here is a Python method:\n\n```python\n{src}\n```\n\nRename the variable `{old}` to "
                 f"`{new}` everywhere in it. Reply with the whole method and nothing else."
                 for src, old, new in _functions()]
    else:
        texts = [f"Repeat the following paragraph exactly, word for word:\n\n{p}" for p in _paragraphs()]
    chats = [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                           tokenize=False) for t in texts[:count]]
    return [(list(tokenizer(c, add_special_tokens=False)["input_ids"]),
             {**sampling, "seed": i} if task == "story" else sampling) for i, c in enumerate(chats)]


def run_case(model, dtype: str, spec: dict | None, requests, concurrency: int, max_tokens: int,
             quantization: str = "none"):
    """(out tok/s, outputs, spec stats): the task's requests (cycled up to `concurrency`) in waves
    of `concurrency` at once; tok/s counts the waves' time only."""
    from llmsvc import LLM, SamplingParams

    llm = LLM(model=model, dtype=dtype, speculative_config=spec, quantization=quantization)
    try:
        warm = SamplingParams(max_tokens=4, temperature=0.0)
        llm.generate([requests[0][0]], warm, use_tqdm=False)  # first-call costs out of the timing
        llm.llm_engine.reset_prefix_cache()
        batch = [requests[i % len(requests)] for i in range(max(concurrency, len(requests)))]
        outs, wall = [], 0.0
        for k in range(0, len(batch), concurrency):  # waves of `concurrency` requests at once
            wave = batch[k:k + concurrency]
            params = [SamplingParams(max_tokens=max_tokens, **kw) for _, kw in wave]
            t0 = time.perf_counter()
            outs += llm.generate([p for p, _ in wave], params, use_tqdm=False)
            wall += time.perf_counter() - t0
        stats = llm.llm_engine.get_stats().spec_decode
    finally:
        llm.shutdown()
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    return sum(map(len, tokens)) / wall, tokens, stats


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", default=None)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--quantization", default="none", choices=["none", "gguf"], help="as `llmsvc serve`'s")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--tasks", nargs="+", choices=TASKS, default=list(TASKS))
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--lookup", type=int, nargs=2, default=[3, 5], metavar=("MIN", "MAX"),
                   help="prompt_lookup_min and prompt_lookup_max")
    p.add_argument("--disable-by-batch-size", type=int, default=None)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=192)
    args = p.parse_args(argv)

    from llmsvc.bench.workloads import ordinary_vocab
    from llmsvc.config import ModelConfig
    from llmsvc.models.resolve import resolve_model_config
    from llmsvc.models.tokenizer import load_tokenizer

    mc = resolve_model_config(ModelConfig(model=args.model))
    tok = load_tokenizer(mc.tokenizer_dir, None)
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": args.lookup[0],
            "prompt_lookup_max": args.lookup[1], "disable_by_batch_size": args.disable_by_batch_size}
    rows = []
    for task in args.tasks:
        requests = build_requests(task, tok, ordinary_vocab(tok))
        for c in args.concurrency:
            runs = {"off": [], "ngram": []}
            outs, stats = {}, None
            for r in range(args.repeats):
                for case in (("off", "ngram") if r % 2 == 0 else ("ngram", "off")):
                    tps, outs[case], st = run_case(args.model, args.dtype, spec if case == "ngram" else None,
                                                   requests, c, args.max_tokens, args.quantization)
                    runs[case].append(tps)
                    stats = st if st is not None else stats
                    print(f"{task} c={c} repeat {r + 1}: {case}: {tps:.1f} out tok/s", flush=True)
            rows.append((task, c, runs, stats, outs["off"] == outs["ngram"],
                         sum(map(len, outs["off"])) / len(outs["off"])))
    cap = "" if args.disable_by_batch_size is None else f", disable_by_batch_size {args.disable_by_batch_size}"
    print(f"\n{args.dtype}, quantization {args.quantization}, ngram k={args.k} lookup {args.lookup[0]}-{args.lookup[1]}{cap}, {args.repeats} repeats, "
          f"max_tokens {args.max_tokens} (median, min-max out tok/s):")
    print("| task | concurrency | mean output tokens | no drafts | ngram | ratio | acceptance rate | "
          "mean acceptance length | same tokens |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for task, c, runs, st, same, mean_len in rows:
        off, on = statistics.median(runs["off"]), statistics.median(runs["ngram"])
        fmt = lambda xs: f"{statistics.median(xs):.1f} ({min(xs):.1f}-{max(xs):.1f})"  # noqa: E731
        print(f"| {task} | {c} | {mean_len:.0f} | {fmt(runs['off'])} | {fmt(runs['ngram'])} | {on / off:.2f}x | "
              f"{100 * st.acceptance_rate:.0f}% | {st.mean_acceptance_length:.2f} | {'yes' if same else 'no'} |")


if __name__ == "__main__":
    main()
