"""allowed_token_ids and bad_words on a tiny random model. allowed: offline and over gRPC every
sampled token is one of the allowed ids, greedy picks the allowed id the unrestricted model
ranks highest, an id outside the vocabulary is INVALID_ARGUMENT naming the element. bad_words:
a banned bigram never appears and the output changes exactly where it would have."""
from __future__ import annotations

import grpc
import pytest

from llmsvc import LLM, SamplingParams
from llmsvc.client import Client
from llmsvc.client.errors import LlmsvcError
from llmsvc.config import EngineConfig
from llmsvc.engine.llm_engine import LLMEngine
from tests.server_harness import EOS, TINY_VOCAB, ServerThread, make_tiny_served_model_dir

PROMPT = [5 + (11 * i) % (EOS - 5) for i in range(12)]
ENGINE = dict(block_size=4, num_kv_blocks_override=64, max_num_seqs=4)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_served_model_dir(tmp_path_factory.mktemp("allowed"))


def test_offline_greedy_and_sampled_stay_in_the_allowed_set(model_dir):
    llm = LLM(model=model_dir, **ENGINE)
    try:
        free = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=1, temperature=0.0, logprobs=20),
                            use_tqdm=False)[0].outputs[0]
        top = free.logprobs[0]  # the top-20 of the unrestricted first step
        ranked = sorted(top, key=lambda t: -top[t].logprob)
        allowed = ranked[3:6]
        greedy, sampled = llm.generate(
            [{"prompt_token_ids": PROMPT}] * 2,
            [SamplingParams(max_tokens=1, temperature=0.0, allowed_token_ids=allowed),
             SamplingParams(max_tokens=12, temperature=1.0, seed=3, allowed_token_ids=allowed, ignore_eos=True)],
            use_tqdm=False)
        assert greedy.outputs[0].token_ids == [allowed[0]]
        assert set(sampled.outputs[0].token_ids) <= set(allowed) and len(sampled.outputs[0].token_ids) == 12
    finally:
        llm.shutdown()


def test_grpc_allowed_token_ids_and_validation(model_dir):
    config = EngineConfig.from_options(model=model_dir, log_stats_interval_s=0.0, **ENGINE)
    with ServerThread(lambda: LLMEngine.from_config(config)) as srv, Client(srv.address, timeout=60) as c:
        allowed = [7, 9, 40]
        r = c.generate(PROMPT, max_tokens=10, temperature=0.8, seed=1, ignore_eos=True, allowed_token_ids=allowed)
        assert len(r.token_ids) == 10 and set(r.token_ids) <= set(allowed)
        with pytest.raises(LlmsvcError) as ei:
            c.generate(PROMPT, max_tokens=2, allowed_token_ids=[7, TINY_VOCAB])
        assert ei.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert ei.value.field_violations[0][0] == "sampling.allowed_token_ids[1]"


def test_bad_words_over_grpc(model_dir):
    """Greedy over the 26 letters: banning the output's first bigram keeps the output up to it,
    changes the token that would complete it, and the bigram never appears; a one-letter word
    never appears at all."""
    letters = list(range(ord("a"), ord("z") + 1))
    kw = dict(max_tokens=24, temperature=0.0, ignore_eos=True, allowed_token_ids=letters)
    config = EngineConfig.from_options(model=model_dir, log_stats_interval_s=0.0, **ENGINE)
    with ServerThread(lambda: LLMEngine.from_config(config)) as srv, Client(srv.address, timeout=60) as c:
        base = c.generate(PROMPT, **kw).token_ids
        pairs = list(zip(base, base[1:]))
        i = 0  # the first bigram; banned, the output must differ at i + 1 and never hold it
        word = bytes(pairs[i]).decode()
        out = c.generate(PROMPT, bad_words=[word], **kw).token_ids
        assert out[:i + 1] == base[:i + 1] and out[i + 1] != base[i + 1]
        assert pairs[i] not in set(zip(out, out[1:]))
        single = chr(base[0])
        out = c.generate(PROMPT, bad_words=[single, "  " + chr(base[1])], **kw).token_ids
        assert base[0] not in out and base[1] not in out and len(out) == 24
        with pytest.raises(LlmsvcError) as ei:
            c.generate(PROMPT, max_tokens=2, bad_words=["ok", " "])
        assert ei.value.field_violations[0][0] == "sampling.bad_words[1]"
