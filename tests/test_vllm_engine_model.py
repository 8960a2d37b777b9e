"""VllmEngine over the REAL engine: a tiny random Llama, the engine core in its own process (as
`llmsvc serve` runs it), so KV events cross ZeroMQ from the core's prefix cache."""
from __future__ import annotations

import io
import zipfile

import pytest

from llmsvc.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from llmsvc.server.app import default_engine_factory
from llmsvc.server.vllm_engine.proto import common_pb2 as cpb
from llmsvc.server.vllm_engine.proto import vllm_engine_pb2 as vpb
from llmsvc.server.vllm_engine.proto import vllm_engine_pb2_grpc as vgrpc
from llmsvc.v1 import llmsvc_pb2 as pb
from tests.server_harness import ServerThread, make_tiny_served_model_dir
from tests.test_vllm_engine_kv_events import Reader, stored_blocks

BLOCK = 16


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_served_model_dir(tmp_path_factory.mktemp("vllm-door-tiny"))


@pytest.fixture(scope="module")
def srv(tiny_dir):
    config = EngineConfig(model_config=ModelConfig(model=tiny_dir, served_name="tiny-llama", max_model_len=256),
                          cache_config=CacheConfig(block_size=BLOCK, num_kv_blocks_override=64),
                          scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256),
                          device="cpu", engine_core="process", log_stats_interval_s=0.0)
    s = ServerThread(default_engine_factory(config))
    s.vllm = vgrpc.VllmEngineStub(s.channel)
    yield s
    s.stop()


def test_greedy_tokens_equal_llmsvc_v1(srv):
    ids = srv.stub.Tokenize(pb.TokenizeRequest(text="the quick brown fox jumps over")).token_ids
    (ref,) = list(srv.stub.Generate(pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingParams(temperature=0.0),
        stopping=pb.StoppingCriteria(max_tokens=16, ignore_eos=True))))
    sp = vpb.SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    msgs = list(srv.vllm.Generate(vpb.GenerateRequest(tokenized=vpb.TokenizedInput(input_ids=ids),
                                                      sampling_params=sp, stream=True)))
    assert [t for m in msgs if m.HasField("chunk") for t in m.chunk.token_ids] == list(ref.token_ids)
    (unary,) = list(srv.vllm.Generate(vpb.GenerateRequest(text="the quick brown fox jumps over", sampling_params=sp)))
    assert list(unary.complete.output_ids) == list(ref.token_ids) and len(ref.token_ids) == 16


def test_kv_events_from_the_core_process_and_flush(srv):
    reader = Reader(srv.vllm)
    reader.next()
    prompt = [(7 * i) % 250 + 1 for i in range(2 * BLOCK + 3)]
    list(srv.vllm.Generate(vpb.GenerateRequest(tokenized=vpb.TokenizedInput(input_ids=prompt),
                                               sampling_params=vpb.SamplingParams(temperature=0.0, max_tokens=2))))
    seen = reader.until(lambda ev: len(stored_blocks(ev)) >= 2)
    blocks = [b for b, _ in stored_blocks([e for b in seen for e in b.events])]
    assert [list(b.token_ids) for b in blocks[:2]] == [prompt[:BLOCK], prompt[BLOCK:2 * BLOCK]]
    (again,) = list(srv.vllm.Generate(vpb.GenerateRequest(tokenized=vpb.TokenizedInput(input_ids=prompt),
                                                          sampling_params=vpb.SamplingParams(max_tokens=1))))
    assert again.complete.cached_tokens == 2 * BLOCK
    assert srv.vllm.FlushCache(cpb.FlushCacheRequest(timeout_s=10.0)).success
    reader.until(lambda ev: any(e.HasField("cleared") for e in ev))
    reader.close()


def test_tokenizer_bundle_has_the_model_files(srv, tmp_path):
    from transformers import AutoTokenizer

    data = b"".join(c.data for c in srv.vllm.GetTokenizer(cpb.GetTokenizerRequest()))
    names = zipfile.ZipFile(io.BytesIO(data)).namelist()
    assert {"tokenizer.json", "tokenizer_config.json", "config.json"} <= set(names)
    zipfile.ZipFile(io.BytesIO(data)).extractall(tmp_path)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    ids = list(srv.stub.Tokenize(pb.TokenizeRequest(text="hello there")).token_ids)
    assert tok("hello there")["input_ids"] == ids
    info = srv.vllm.GetModelInfo(vpb.GetModelInfoRequest())
    assert info.served_model_name == "tiny-llama" and list(info.architectures) == ["LlamaForCausalLM"]
    assert info.model_type == "llama"
