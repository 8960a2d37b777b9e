"""What serving LoRA adapters costs, offline, in one command:

    .venv/bin/python -m benchmarks.lora [--workload W2] [--rank 16] [--repeats 2] [--dtype bfloat16] [MODEL]

writes a random rank-`--rank` adapter on every projection of MODEL (default: SmolLM2-135M), then
runs the workload's prompts (greedy, EOS ignored) through `LLM.generate` in four set-ups, taking
turns per repeat: no adapters served; adapters served but every request on the base model; every
request on the adapter; half the requests on it; and, for scale, no adapters with the CPU's
whole-stack native call off (LLMSVC_NATIVE_LAYERS=0: the per-layer path a step with an adapter
takes). Prints output tok/s (median, min-max) and each
set-up against the first.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import tempfile
import time

import torch

CASES = ("no adapters served", "served, base requests", "every request on the adapter", "half on the adapter",
         "no adapters, layer by layer")


def write_random_adapter(model_config, out_dir: str, rank: int, seed: int = 0) -> str:
    """A PEFT adapter with random A and B (B scaled so the update is ~1% of the layer's output)."""
    from safetensors.torch import save_file

    cfg = model_config.hf_config
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    q, kv, h, i = cfg.num_attention_heads * d, cfg.num_key_value_heads * d, cfg.hidden_size, cfg.intermediate_size
    shapes = {"self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
              "self_attn.o_proj": (h, q), "mlp.gate_proj": (i, h), "mlp.up_proj": (i, h), "mlp.down_proj": (h, i)}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_hidden_layers):
        for module, (n_out, n_in) in shapes.items():
            name = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(rank, n_in, generator=g) / math.sqrt(n_in)
            tensors[f"{name}.lora_B.weight"] = 0.01 * torch.randn(n_out, rank, generator=g) / math.sqrt(rank)
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "adapter_model.safetensors"))
    with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": [
            m.split(".")[1] for m in shapes], "bias": "none"}, f)
    return out_dir


def run_case(model, dtype: str, case: str, adapter: str, rank: int, prompts, output_len: int) -> float:
    from llmsvc import LLM, SamplingParams

    served = {} if case in (CASES[0], CASES[4]) else {"lora_modules": {"a": adapter}, "max_lora_rank": rank}
    os.environ["LLMSVC_NATIVE_LAYERS"] = "0" if case == CASES[4] else "1"
    llm = LLM(model=model, dtype=dtype, **served)  # inline engine, uniproc: the model reads the variable here
    try:
        loras = {CASES[0]: None, CASES[1]: None, CASES[2]: "a"}.get(case)
        loras = [loras] * len(prompts) if case != CASES[3] else ["a" if k % 2 else None for k in range(len(prompts))]
        params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
        llm.generate(prompts[:2], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False,
                     lora_request=loras[:2])  # first-call costs out of the timing
        llm.llm_engine.reset_prefix_cache()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
        wall = time.perf_counter() - t0
    finally:
        llm.shutdown()
    return sum(len(o.outputs[0].token_ids) for o in outs) / wall


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", default=None)
    p.add_argument("--workload", default="W2")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--dtype", default="float32")
    args = p.parse_args(argv)

    from llmsvc.bench.workloads import build_prompts, get_workload, ordinary_vocab
    from llmsvc.config import ModelConfig
    from llmsvc.models.resolve import resolve_model_config
    from llmsvc.models.tokenizer import load_tokenizer

    mc = resolve_model_config(ModelConfig(model=args.model))
    w = get_workload(args.workload)
    prompts = build_prompts(w, ordinary_vocab(load_tokenizer(mc.tokenizer_dir, None)))
    results: dict[str, list[float]] = {c: [] for c in CASES}
    with tempfile.TemporaryDirectory() as tmp:
        adapter = write_random_adapter(mc, os.path.join(tmp, "adapter"), args.rank)
        for r in range(args.repeats):
            for case in (CASES if r % 2 == 0 else CASES[::-1]):
                results[case].append(run_case(args.model, args.dtype, case, adapter, args.rank, prompts, w.output_len))
                print(f"repeat {r + 1}: {case}: {results[case][-1]:.1f} out tok/s", flush=True)
    base = statistics.median(results[CASES[0]])
    print(f"\n{args.workload} {args.dtype}, rank {args.rank}, {args.repeats} repeats (median, min-max out tok/s):")
    for case, runs in results.items():
        med = statistics.median(runs)
        print(f"  {case:30s} {med:8.1f} ({min(runs):.1f}-{max(runs):.1f})  {med / base:.3f}x")


if __name__ == "__main__":
    main()
