"""cache_salt: requests reuse cached prompt blocks only within one salt, over gRPC (the Python
client's keyword, a server whose engine core runs in its own process) and offline (vLLM's
prompt dict key); a bad salt is INVALID_ARGUMENT naming the field."""
from __future__ import annotations

import grpc
import pytest

from llmsvc import LLM, SamplingParams
from llmsvc.client import Client
from llmsvc.client.errors import LlmsvcError
from llmsvc.config import EngineConfig
from llmsvc.engine.llm_engine import LLMEngine
from tests.server_harness import EOS, ServerThread, make_tiny_served_model_dir

PROMPT = [5 + (7 * i) % (EOS - 5) for i in range(40)]  # 10 blocks of 4 tokens
ENGINE = dict(block_size=4, num_kv_blocks_override=64, max_num_seqs=4)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_served_model_dir(tmp_path_factory.mktemp("salt"))


def cached(client: Client, **kw) -> int:
    result = client.generate(PROMPT, max_tokens=2, temperature=0.0, **kw)
    assert len(result.token_ids) == 2
    return result.prompt.num_cached_tokens


def test_grpc_prefix_cache_is_shared_only_within_a_salt(model_dir):
    config = EngineConfig.from_options(model=model_dir, engine_core="process", log_stats_interval_s=0.0, **ENGINE)
    with ServerThread(lambda: LLMEngine.from_config(config)) as srv, Client(srv.address, timeout=60) as c:
        assert cached(c, cache_salt="tenant-a") == 0
        assert cached(c, cache_salt="tenant-a") == 36  # 9 full blocks; the last token is computed
        assert cached(c, cache_salt="tenant-b") == 0
        assert cached(c) == 0  # no salt: a group of its own
        assert cached(c) == 36
        for bad, why in (("", "non-empty"), ("x" * 257, "at most 256")):
            with pytest.raises(LlmsvcError) as ei:
                c.generate(PROMPT, max_tokens=2, cache_salt=bad)
            assert ei.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert ei.value.field_violations[0][0] == "cache_salt" and why in ei.value.field_violations[0][1]
        info = c.server_info()
        assert info.num_free_kv_blocks == info.num_kv_blocks  # cached blocks are free to evict


def test_llm_prompt_dict_cache_salt(model_dir):
    llm = LLM(model=model_dir, **ENGINE)
    try:
        greedy = SamplingParams(max_tokens=2, temperature=0.0)
        first, = llm.generate({"prompt_token_ids": PROMPT, "cache_salt": "a"}, greedy, use_tqdm=False)
        outs = llm.generate([{"prompt_token_ids": PROMPT, "cache_salt": "a"},
                             {"prompt_token_ids": PROMPT, "cache_salt": "b"}], greedy, use_tqdm=False)
        assert [o.num_cached_tokens for o in outs] == [36, 0]
        assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids == first.outputs[0].token_ids
        with pytest.raises(ValueError, match="cache_salt"):
            llm.generate({"prompt_token_ids": PROMPT, "cache_salt": ""}, greedy, use_tqdm=False)
    finally:
        llm.shutdown()
