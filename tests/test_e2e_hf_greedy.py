"""Greedy tokens and logprobs through the whole CPU engine (scheduler, uniproc worker, paged cache)
equal transformers' on the same tiny weights, with chunked prefill, recompute-preemption from a
tiny KV pool and steps that mix prefill chunks with decodes.

The rope base is small (theta 20) so that every position rotates q/k noticeably: a token computed
at the wrong position changes the logits even over the first decode steps.
"""
from __future__ import annotations

import random

import pytest
import torch

from llmsvc import LLM, SamplingParams
from tests.model_utils import load_hf_model
from tests.server_harness import make_tiny_served_model_dir

MAX_TOKENS = 24
PROMPT_LENS = (5, 37, 23, 11, 30)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_served_model_dir(tmp_path_factory.mktemp("hf-greedy"), max_position_embeddings=128,
                                      rope_parameters={"rope_type": "default", "rope_theta": 20.0})


@torch.no_grad()
def hf_greedy(model, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """Greedy continuation by full recompute (no KV cache), with each token's logprob."""
    ids, lps = list(prompt), []
    for _ in range(n):
        logits = model(torch.tensor([ids])).logits[0, -1].float()
        tok = int(logits.argmax())
        lps.append(float(torch.log_softmax(logits, -1)[tok]))
        ids.append(tok)
    return ids[len(prompt):], lps


def test_greedy_matches_transformers_through_the_scheduler(model_dir):
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 256) for _ in range(n)] for n in PROMPT_LENS]
    # 20 blocks of 4 tokens hold 80 tokens: the five requests (up to 61 tokens each) cannot all stay
    # resident; a 16-token budget chunks every prompt above 16 tokens
    llm = LLM(model=model_dir, executor="uniproc", device="cpu", max_model_len=128, block_size=4,
              num_kv_blocks_override=20, max_num_batched_tokens=16, max_num_seqs=4)
    steps = []
    core = llm.llm_engine.core
    execute = core.executor.execute_model

    def record(so):  # (prefill tokens, decode requests) of each step, read before the step runs
        reqs = core.scheduler.requests
        decodes = sum(1 for rid in so.num_scheduled_tokens
                      if reqs[rid].num_computed_tokens >= reqs[rid].num_prompt_tokens)
        steps.append((so.total_num_scheduled_tokens - decodes, decodes))
        return execute(so)
    core.executor.execute_model = record
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
        outs = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.llm_engine.get_stats()
    finally:
        llm.shutdown()
    assert stats.num_preemptions > 0, "the pool was meant to force recompute-preemption"
    assert any(p > 0 and d > 0 for p, d in steps), "no step mixed prefill chunks with decodes"
    assert max(p for p, _ in steps) <= 16 < max(PROMPT_LENS)  # long prompts were chunked
    hf = load_hf_model(model_dir)
    for prompt, out in zip(prompts, outs):
        want_ids, want_lps = hf_greedy(hf, prompt, MAX_TOKENS)
        comp = out.outputs[0]
        assert comp.token_ids == want_ids, f"prompt of {len(prompt)} tokens diverged"
        got_lps = [lp[t].logprob for t, lp in zip(comp.token_ids, comp.logprobs)]
        assert got_lps == pytest.approx(want_lps, abs=1e-3)
