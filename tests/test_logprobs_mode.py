"""logprobs_mode on a tiny random model: raw logprobs are the model's distribution, processed
ones the distribution sampled from; with temperature 0.5 the processed log-odds of two tokens
are twice the raw ones, the sampled tokens are the same, and a bad mode is refused."""
from __future__ import annotations

import argparse

import pytest

from llmsvc import LLM, SamplingParams
from llmsvc.server import cli
from tests.server_harness import EOS, make_tiny_served_model_dir

PROMPT = [5 + (13 * i) % (EOS - 5) for i in range(10)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_served_model_dir(tmp_path_factory.mktemp("lpmode"))


def first_step(model_dir, mode):
    llm = LLM(model=model_dir, logprobs_mode=mode, block_size=4, num_kv_blocks_override=32)
    try:
        params = SamplingParams(max_tokens=4, temperature=0.5, seed=5, logprobs=5, ignore_eos=True)
        (out,) = llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)
    finally:
        llm.shutdown()
    return out.outputs[0].token_ids, out.outputs[0].logprobs[0]


def test_processed_logprobs_are_the_tempered_distribution(model_dir):
    raw_tokens, raw = first_step(model_dir, "raw_logprobs")
    tokens, processed = first_step(model_dir, "processed_logprobs")
    assert tokens == raw_tokens
    both = [t for t in raw if t in processed]
    assert len(both) >= 2
    a, b = both[:2]
    raw_odds = raw[a].logprob - raw[b].logprob
    assert processed[a].logprob - processed[b].logprob == pytest.approx(2 * raw_odds, abs=1e-3)
    assert raw_odds != pytest.approx(0, abs=1e-3)


def test_bad_mode_is_refused():
    with pytest.raises(ValueError, match="logprobs_mode"):
        LLM(model="unused", logprobs_mode="raw_logits")
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--logprobs-mode", "raw_logits"])
    args = parser.parse_args(["--logprobs-mode", "processed_logprobs"])
    assert cli.build_config(args).logprobs_mode == "processed_logprobs"
