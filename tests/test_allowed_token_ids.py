"""allowed_token_ids on a tiny random model: offline and over gRPC every sampled token is one
of the allowed ids, greedy picks the allowed id the unrestricted model ranks highest, and an
id outside the vocabulary is INVALID_ARGUMENT naming the element."""
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
