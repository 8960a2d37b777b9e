"""KV blocks held with and without releasing blocks behind the sliding window.

    python -m benchmarks.sliding_window_kv                  # a random Mistral-shaped model, window 256
    python -m benchmarks.sliding_window_kv --window 512 --prompt-len 2048 --output-len 256

Builds the small random Mistral checkpoint of benchmarks/family_models.py with the given
window, runs N greedy requests through the offline engine twice (the KV manager releasing
blocks behind the window, then keeping every block), and prints, for each run, the peak number
of blocks in use in the pool and its size in bytes, plus whether both runs gave the same tokens.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import tempfile

from benchmarks.family_models import VOCAB, make


def run(model: str, prompts: list[list[int]], output_len: int, release: bool, block_size: int,
        budget: int) -> dict:
    from llmsvc import LLM, SamplingParams
    llm = LLM(model, max_num_seqs=len(prompts), max_num_batched_tokens=budget, block_size=block_size,
              kv_cache_memory="1GiB")
    kv = llm.llm_engine.core.kv_cache_manager
    if not release:
        kv.sliding_window = None
    peak = 0
    allocate = kv.allocate_slots

    def recording(*a, **k):
        nonlocal peak
        out = allocate(*a, **k)
        peak = max(peak, kv.num_blocks - kv.num_free_blocks)
        return out
    kv.allocate_slots = recording
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.shutdown()
    cfg = llm.llm_engine.config.model_config.hf_config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    block_bytes = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * block_size * 4  # fp32 K + V
    return {"release": release, "peak_blocks": peak, "peak_bytes": peak * block_bytes,
            "tokens": [list(o.outputs[0].token_ids) for o in outs]}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-requests", type=int, default=4)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=256)
    a = p.parse_args(argv)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(a.prompt_len)] for _ in range(a.num_requests)]
    with tempfile.TemporaryDirectory() as tmp:
        model = make("mistral", os.path.join(tmp, "m"), sliding_window=a.window,
                     max_position_embeddings=a.prompt_len + a.output_len)
        runs = [run(model, prompts, a.output_len, r, a.block_size, a.max_num_batched_tokens) for r in (True, False)]
    same = runs[0]["tokens"] == runs[1]["tokens"]
    for r in runs:
        r.pop("tokens")
    print(json.dumps({"args": vars(a), "runs": runs, "same_tokens": same}, indent=1))


if __name__ == "__main__":
    main()
