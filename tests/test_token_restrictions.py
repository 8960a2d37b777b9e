"""allowed_token_ids and bad_words on a tiny random model. allowed: offline and over gRPC every
sampled token is one of the allowed ids, greedy picks the allowed id the unrestricted model
ranks highest, an id outside the vocabulary is INVALID_ARGUMENT naming the element. bad_words:
a banned bigram never appears and the output changes exactly where it would have. Rules that
leave nothing to sample: refused up front where the first token shows it, else the request
ends "abort" with the reason and no stray token."""
from __future__ import annotations

import grpc
import pytest

from llmsvc import LLM, SamplingParams
from llmsvc.client import Client
from llmsvc.client.errors import LlmsvcError
from llmsvc.config import EngineConfig
from llmsvc.engine.llm_engine import LLMEngine
from llmsvc.worker.model_runner import first_token_from_an_empty_row
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


def test_token_rules_that_leave_nothing_end_the_request_without_a_stray_token(model_dir):
    """allowed 'a' with the bad word 'aa': the first 'a' is fine, then every allowed token is
    banned. The request ends "abort" with the reason, after its one real token (an argmax over
    an all -inf row would have emitted token 0, which it never allowed)."""
    a = ord("a")
    llm = LLM(model=model_dir, **ENGINE)
    try:
        outs = llm.generate([{"prompt_token_ids": PROMPT}] * 3,
                            [SamplingParams(max_tokens=6, temperature=t, seed=2, ignore_eos=True,
                                            allowed_token_ids=[a], bad_words=["aa"]) for t in (0.0, 1.0)]
                            + [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)],
                            use_tqdm=False)
        for out in outs[:2]:
            o = out.outputs[0]
            assert (o.finish_reason, o.token_ids) == ("abort", [a])
            assert "left no token to sample" in out.abort_reason
        assert outs[2].outputs[0].finish_reason == "length" and len(outs[2].outputs[0].token_ids) == 6
        assert not llm.llm_engine.has_unfinished_requests()
    finally:
        llm.shutdown()


def test_allowed_tokens_all_forbidden_at_the_first_token_are_invalid_argument(model_dir):
    a = ord("a")
    config = EngineConfig.from_options(model=model_dir, log_stats_interval_s=0.0, **ENGINE)
    with ServerThread(lambda: LLMEngine.from_config(config)) as srv, Client(srv.address, timeout=60) as c:
        for kw in (dict(allowed_token_ids=[a], bad_words=["a"]),  # a one-token bad word
                   dict(allowed_token_ids=[EOS], min_tokens=2),  # EOS held back by min_tokens
                   dict(allowed_token_ids=[a, 7], stop_token_ids=[7], min_tokens=1, bad_words=["a"])):
            with pytest.raises(LlmsvcError) as ei:
                c.generate(PROMPT, max_tokens=4, **kw)
            assert ei.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert ei.value.field_violations[0][0] == "sampling.allowed_token_ids"
        # one allowed token left over, or EOS not held back (ignore_eos): served
        r = c.generate(PROMPT, max_tokens=3, allowed_token_ids=[a, ord("b")], bad_words=["a"], ignore_eos=True)
        assert r.token_ids == [ord("b")] * 3
        r = c.generate(PROMPT, max_tokens=3, allowed_token_ids=[EOS], min_tokens=2, ignore_eos=True)
        assert r.token_ids == [EOS] * 3


def test_the_first_token_from_an_empty_row_is_found_per_request():
    # one row each: a dead row marks that request's only token
    assert first_token_from_an_empty_row([1], ["x", "y"], [[5], [6]], None) == {"y": 0}
    # with drafts: x has rows 0-2 and kept 3 tokens, y rows 3-4 and kept 1 (its row 4 unused)
    sampled = [[5, 6, 7], [8]]
    assert first_token_from_an_empty_row([2, 4], ["x", "y"], sampled, [3, 2]) == {"x": 2}
    assert first_token_from_an_empty_row([3], ["x", "y"], sampled, [3, 2]) == {"y": 0}
    assert first_token_from_an_empty_row([], ["x"], [[5]], None) == {}
