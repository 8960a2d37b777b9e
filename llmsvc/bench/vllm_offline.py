"""Runs inside vLLM's interpreter (`llmsvc bench --baseline vllm --vllm-python PATH`): vLLM's
offline `LLM.generate` on token-id prompts. Imports only vllm and the standard library, so it
runs in a venv without llmsvc (it is started as a file path, not as a module of llmsvc).

Protocol, one JSON object per line:
  stdout <- {"ready": true, "vllm_version": ...} once the model is loaded and warmed up
  stdin  -> {"prompts": [[token ids], ...], "max_tokens": N}          a job
  stdout <- {"wall_s": s, "ttft_source": str | null, "records": [...]}  its result; a record is
            {"prompt_len", "output_len", "ttft_s", "decode_s"} (ttft_s, decode_s null when
            vLLM's RequestOutput carries no metrics)
  stdin EOF -> exit 0.  A failure -> {"error": "..."} and exit 1.
Everything vLLM itself prints goes to stderr: stdout carries only the protocol.

Decoding is greedy with ignore_eos, so each request yields exactly max_tokens tokens. Before
the clock starts a job's first 8 prompts, reversed (a step of the workload's shape that shares
no prefix with it), are generated for 2 tokens, as `llmsvc bench` warms every system up
(llmsvc/bench/fairness.py, warmup_prompts)."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time


def _protocol_stream():
    """A text stream on the original stdout; fd 1 then points at stderr, so that C and Python
    prints from vLLM and torch cannot interleave with the protocol."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    sys.stdout.flush()
    os.dup2(2, 1)
    return out


def _record(o) -> dict:
    """One RequestOutput as a record. metrics.first_token_latency is measured by vLLM's front end
    from the request's arrival; first/last_token_ts are engine-core timestamps of one clock."""
    m = getattr(o, "metrics", None)
    n = len(o.outputs[0].token_ids)
    ttft = getattr(m, "first_token_latency", None) if m is not None else None
    first, last = (getattr(m, "first_token_ts", 0.0), getattr(m, "last_token_ts", 0.0)) if m else (0.0, 0.0)
    return {"prompt_len": len(o.prompt_token_ids), "output_len": n,
            "ttft_s": ttft if ttft else None,
            "decode_s": (last - first) if (ttft and last >= first > 0) else None}


def _generate(llm, prompts: list[list[int]], max_tokens: int):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens, ignore_eos=True)
    return llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)


def serve_jobs(llm, lines, out) -> None:
    for line in lines:
        if not line.strip():
            continue
        job = json.loads(line)
        prompts, max_tokens = job["prompts"], int(job["max_tokens"])
        _generate(llm, [p[::-1] for p in prompts[:8]], 2)  # warm-up, outside the clock
        reset = getattr(llm, "reset_prefix_cache", None)
        if reset is not None:  # every job from an empty prefix cache, as each of llmsvc's runs
            reset()
        t0 = time.perf_counter()
        outs = _generate(llm, prompts, max_tokens)
        wall = time.perf_counter() - t0
        records = [_record(o) for o in outs]
        source = "RequestOutput.metrics" if all(r["ttft_s"] is not None for r in records) else None
        out.write(json.dumps({"wall_s": wall, "ttft_source": source, "records": records}) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="HF model directory (nothing is fetched from a hub)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-cache-memory-bytes", type=int, default=2 << 30,
                   help="KV cache size (without it vLLM's CPU build reserves 92%% of the machine's memory)")
    a = p.parse_args(argv)
    out = _protocol_stream()
    try:
        import vllm
        from vllm import LLM

        # disable_log_stats=False: without it LLM leaves RequestOutput.metrics empty (no TTFT)
        llm = LLM(model=a.model, dtype=a.dtype, seed=a.seed, kv_cache_memory_bytes=a.kv_cache_memory_bytes,
                  disable_log_stats=False)
        _generate(llm, [[1] * 16], 4)
        out.write(json.dumps({"ready": True, "vllm_version": getattr(vllm, "__version__", None)}) + "\n")
        serve_jobs(llm, sys.stdin, out)
    except Exception as e:  # reported on the protocol stream; the traceback went to stderr
        import traceback

        traceback.print_exc()
        out.write(json.dumps({"error": f"{type(e).__name__}: {e}"}) + "\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
