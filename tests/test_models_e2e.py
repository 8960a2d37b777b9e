"""The real default model (SmolLM2-135M-Instruct, converted from the shipped GGUF):
our greedy decoding over the paged cache, all prompts in one batch, equals transformers'
generate token for token."""
from __future__ import annotations

import pytest
import torch

from model_utils import PagedRunner, load_hf_model, load_our_model

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.",
           "List three prime numbers and explain why they are prime."]
NEW_TOKENS = 64


@pytest.mark.e2e
def test_greedy_matches_transformers_generate(default_model_dir):
    from transformers import AutoTokenizer
    d = default_model_dir
    tok = AutoTokenizer.from_pretrained(d)
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                       tokenize=True, return_dict=False) for p in PROMPTS]
    prompts = [list(p["input_ids"]) if isinstance(p, dict) else list(p) for p in prompts]
    torch.manual_seed(0)
    ours = PagedRunner(load_our_model(d, max_model_len=1024), num_blocks=32, block_size=16, seed=3)
    got = ours.greedy_generate(dict(enumerate(prompts)), NEW_TOKENS)
    hf = load_hf_model(d)
    hf.generation_config.eos_token_id = None  # both sides run the full NEW_TOKENS, past any EOS
    for i, p in enumerate(prompts):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              max_new_tokens=NEW_TOKENS, do_sample=False,
                              pad_token_id=tok.pad_token_id)[0, len(p):].tolist()
        assert got[i] == ref, f"prompt {i}: {tok.decode(got[i])!r} != {tok.decode(ref)!r}"
    assert len({tuple(g) for g in got.values()}) == len(PROMPTS)
