"""vLLM's engine protocol (vllm.grpc.engine.VllmEngine) served beside llmsvc.v1: LlmServer over a
real loopback port, real LLMEngine on the FakeExecutor (tests/server_harness.py).

Covers Generate (tokenized and text input, the stream shape, n>1 indexes, stops, logprobs, the
same tokens as llmsvc.v1), errors on this proto's field paths, Abort freeing every KV block,
HealthCheck while draining, GetModelInfo / GetLoads / GetServerInfo, GetTokenizer's archive,
SubscribeKvEvents (snapshot, stored blocks, cursor, FlushCache), Embed, health and reflection.
"""
from __future__ import annotations

import hashlib
import io
import zipfile

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmsvc.server.vllm_engine.proto import common_pb2 as cpb
from llmsvc.server.vllm_engine.proto import vllm_engine_pb2 as vpb
from llmsvc.server.vllm_engine.proto import vllm_engine_pb2_grpc as vgrpc
from llmsvc.v1 import llmsvc_pb2 as pb
from tests.reliability_utils import rpc_details
from tests.server_harness import ServerThread, fake_engine_factory, tiny_tokenizer
from tests.test_server import _list_services, free_blocks_back

VLLM = "vllm.grpc.engine.VllmEngine"
PROMPT = [104, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100]  # "hello world", 11 tokens
GREEDY = dict(temperature=0.0)


@pytest.fixture(scope="module")
def srv():
    s = ServerThread(fake_engine_factory(num_blocks=64, step_delay=0.003, max_model_len=256))
    s.vllm = vgrpc.VllmEngineStub(s.channel)
    yield s
    s.stop()


def vgen(ids=PROMPT, stream=False, rid="", **sp) -> vpb.GenerateRequest:
    return vpb.GenerateRequest(request_id=rid, tokenized=vpb.TokenizedInput(input_ids=ids), stream=stream,
                               sampling_params=vpb.SamplingParams(**sp))


def v1_tokens(s, **kw) -> list[int]:
    (final,) = list(s.stub.Generate(pb.GenerateRequest(**kw)))
    return list(final.token_ids)


def test_tokens_equal_llmsvc_v1_tokenized_and_text(srv):
    ref = v1_tokens(srv, token_ids=pb.TokenIds(ids=PROMPT), sampling=pb.SamplingParams(temperature=0.0),
                    stopping=pb.StoppingCriteria(max_tokens=12))
    (c,) = list(srv.vllm.Generate(vgen(max_tokens=12, **GREEDY)))
    assert list(c.complete.output_ids) == ref and len(ref) == 12
    assert (c.complete.finish_reason, c.complete.prompt_tokens, c.complete.completion_tokens) == ("length", 11, 12)
    text = vpb.GenerateRequest(text="hello world", sampling_params=vpb.SamplingParams(max_tokens=12, **GREEDY))
    (t,) = list(srv.vllm.Generate(text))
    assert list(t.complete.output_ids) == ref
    assert t.complete.cached_tokens > 0  # the same prompt again: its full blocks came from the prefix cache


def test_stream_chunks_then_a_complete_with_the_last_tokens(srv):
    msgs = list(srv.vllm.Generate(vgen(stream=True, max_tokens=9, **GREEDY)))
    (unary,) = list(srv.vllm.Generate(vgen(max_tokens=9, **GREEDY)))
    kinds = [m.WhichOneof("response") for m in msgs]
    assert kinds == ["chunk"] * (len(msgs) - 1) + ["complete"]
    chunks = [m.chunk for m in msgs[:-1]]
    assert [t for c in chunks for t in c.token_ids] == list(unary.complete.output_ids)
    assert all(c.completion_tokens == len(c.token_ids) and c.prompt_tokens == 11 for c in chunks)
    last = msgs[-1].complete
    assert list(last.output_ids) == list(chunks[-1].token_ids)  # a gateway accumulates the chunks
    assert (last.finish_reason, last.completion_tokens, last.prompt_tokens) == ("length", 9, 11)


def test_n_samples_carry_their_index(srv):
    sp = dict(max_tokens=6, n=3, temperature=1.0, seed=7)
    msgs = list(srv.vllm.Generate(vgen(stream=True, **sp)))
    completes = [m.complete for m in msgs if m.HasField("complete")]
    assert sorted(c.index for c in completes) == [0, 1, 2]
    for c in completes:  # every index's chunks end before its complete
        streamed = [t for m in msgs if m.HasField("chunk") and m.chunk.index == c.index for t in m.chunk.token_ids]
        assert len(streamed) == 6 and c.completion_tokens == 6
    unary = list(srv.vllm.Generate(vgen(**sp)))
    assert [m.complete.index for m in unary] == [0, 1, 2]
    assert all(len(m.complete.output_ids) == 6 for m in unary)


def test_stop_token_and_stop_string_are_reported(srv):
    (ref,) = list(srv.vllm.Generate(vgen(max_tokens=8, **GREEDY)))
    out = list(ref.complete.output_ids)
    (c,) = list(srv.vllm.Generate(vgen(max_tokens=8, stop_token_ids=[out[3]], **GREEDY)))
    assert c.complete.finish_reason == "stop" and c.complete.matched_token_id == out[3]
    assert list(c.complete.output_ids) == out[:out.index(out[3]) + 1]
    stop = bytes(out[2:4]).decode()
    (s,) = list(srv.vllm.Generate(vgen(max_tokens=8, stop=[stop], **GREEDY)))
    assert s.complete.finish_reason == "stop" and s.complete.matched_stop_str == stop
    (lng,) = list(srv.vllm.Generate(vgen(max_tokens=8, stop=["not in the output"], **GREEDY)))
    assert lng.complete.finish_reason == "length" and not lng.complete.HasField("matched_stop_str")


def test_logprobs_and_prompt_logprobs(srv):
    (c,) = list(srv.vllm.Generate(vgen(max_tokens=4, logprobs=2, prompt_logprobs=1, **GREEDY)))
    lp = c.complete.output_logprobs
    assert list(lp.token_ids) == list(c.complete.output_ids) and len(lp.token_logprobs) == 4
    assert all(len(t.values) == 2 and len(t.token_ids) == 2 for t in lp.top_logprobs)
    ilp = c.complete.input_logprobs
    assert list(ilp.token_ids) == PROMPT and not ilp.token_logprobs[0].HasField("value")
    assert all(v.HasField("value") for v in ilp.token_logprobs[1:])
    msgs = list(srv.vllm.Generate(vgen(stream=True, max_tokens=4, logprobs=0, prompt_logprobs=0, **GREEDY)))
    assert list(msgs[0].chunk.input_logprobs.token_ids) == PROMPT
    assert not any(m.chunk.HasField("input_logprobs") for m in msgs[1:-1])
    assert sum(len(m.chunk.output_logprobs.token_ids) for m in msgs[:-1]) == 4


def _invalid(s, req) -> tuple[str, str]:
    with pytest.raises(grpc.RpcError) as ei:
        list(s.vllm.Generate(req))
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT, ei.value.details()
    (violation,) = rpc_details(ei.value)["BadRequest"].field_violations
    return violation.field, ei.value.details()


@pytest.mark.parametrize("req, field", [
    (vgen(top_p=2.0), "sampling_params.top_p"),
    (vgen(max_tokens=4, logprobs=-1), "sampling_params.logprobs"),
    (vgen(min_tokens=9, max_tokens=4), "sampling_params.min_tokens"),
    (vgen(ids=[104, 999]), "tokenized.input_ids[1]"),
    (vgen(ids=[]), "tokenized.input_ids"),
    (vgen(ids=[104] * 300), "tokenized.input_ids"),  # longer than max_model_len
    (vgen(max_tokens=4, truncate_prompt_tokens=0), "sampling_params.truncate_prompt_tokens"),
    (vgen(max_tokens=4, structural_tag="{}"), "sampling_params.structural_tag"),
    (vgen(max_tokens=4, json_schema="{not json"), "sampling_params.json_schema"),
    (vgen(max_tokens=4, choice=vpb.ChoiceConstraint()), "sampling_params.choice.choices"),
    (vpb.GenerateRequest(text="hi", mm_inputs=vpb.MultimodalInputs(mm_hashes=["x"])), "mm_inputs"),
    (vpb.GenerateRequest(text="hi", kv_transfer_params_json="{}"), "kv_transfer_params_json"),
    (vpb.GenerateRequest(text="hi", data_parallel_rank=1), "data_parallel_rank"),
    (vpb.GenerateRequest(sampling_params=vpb.SamplingParams(max_tokens=4)), "input"),
])
def test_bad_input_is_invalid_argument_on_the_proto_path(srv, req, field):
    assert _invalid(srv, req)[0] == field


def test_truncation_and_seed_translations(srv):
    (full,) = list(srv.vllm.Generate(vgen(ids=PROMPT[-4:], max_tokens=5, **GREEDY)))
    (cut,) = list(srv.vllm.Generate(vgen(max_tokens=5, truncate_prompt_tokens=4, **GREEDY)))
    assert cut.complete.prompt_tokens == 4 and list(cut.complete.output_ids) == list(full.complete.output_ids)
    (keep,) = list(srv.vllm.Generate(vgen(max_tokens=5, truncate_prompt_tokens=-1, **GREEDY)))
    assert keep.complete.prompt_tokens == 11
    a, b = (list(srv.vllm.Generate(vgen(max_tokens=6, temperature=1.0, seed=-5)))[0].complete.output_ids
            for _ in range(2))
    assert a == b  # a negative int32 seed is a seed (its unsigned value), not an error


def test_abort_by_id_ends_the_stream_and_frees_every_block(srv):
    call = srv.vllm.Generate(vgen(rid="to-abort", stream=True, max_tokens=200, ignore_eos=True, **GREEDY))
    assert next(call).HasField("chunk")
    srv.vllm.Abort(vpb.AbortRequest(request_ids=["to-abort", "unknown"]))
    rest = list(call)
    assert rest[-1].complete.finish_reason == "abort" and rest[-1].complete.completion_tokens < 200
    free_blocks_back(srv)


def test_model_server_info_and_loads(srv):
    info = srv.vllm.GetModelInfo(vpb.GetModelInfoRequest())
    assert info.is_generation and info.max_context_length == 256 and info.vocab_size == 259
    assert list(info.eos_token_ids) == [256] and list(info.architectures) == ["FakeForCausalLM"]
    assert info.served_model_name and info.max_req_input_len == 255
    loads = srv.vllm.GetLoads(vpb.GetLoadsRequest())
    (load,) = loads.loads
    assert loads.dp_rank_count == 1 and load.max_total_num_tokens == 64 * 4 and load.max_running_requests == 8
    assert 0.0 <= load.token_usage <= 1.0 and load.cache_hit_rate > 0.0  # earlier tests shared prefixes
    assert load.utilization == load.token_usage  # KV usage, as vLLM's and SGLang's servicers report it
    server = srv.vllm.GetServerInfo(vpb.GetServerInfoRequest())
    assert server.block_size == 4 and server.max_num_seqs == 8 and not server.is_paused
    # vLLM's spellings: the model's torch dtype, and "auto" for a cache in that dtype
    assert server.model_dtype.startswith("torch.") and server.kv_cache_dtype == "auto"
    with pytest.raises(grpc.RpcError) as ei:
        srv.vllm.Embed(vpb.EmbedRequest(tokenized=vpb.TokenizedInput(input_ids=PROMPT)))
    assert ei.value.code() == grpc.StatusCode.UNIMPLEMENTED and "Embed" in ei.value.details()


def test_tokenizer_bundle_loads_with_transformers(srv, tmp_path):
    from transformers import AutoTokenizer

    chunks = list(srv.vllm.GetTokenizer(cpb.GetTokenizerRequest()))
    data = b"".join(c.data for c in chunks)
    assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest() and not any(c.sha256 for c in chunks[:-1])
    zipfile.ZipFile(io.BytesIO(data)).extractall(tmp_path)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    assert tok("hello world")["input_ids"] == tiny_tokenizer()("hello world")["input_ids"] == PROMPT
    assert tok.chat_template == tiny_tokenizer().chat_template and tok.eos_token_id == 256


def test_health_and_reflection_list_the_service(srv):
    h = health_pb2_grpc.HealthStub(srv.channel)
    assert h.Check(health_pb2.HealthCheckRequest(service=VLLM)).status == health_pb2.HealthCheckResponse.SERVING
    assert srv.vllm.HealthCheck(vpb.HealthCheckRequest()).healthy
    for version in ("v1", "v1alpha"):
        assert VLLM in _list_services(srv.channel, version)


def test_health_check_false_while_draining_then_unavailable():
    with ServerThread(fake_engine_factory(num_blocks=64, step_delay=0.01)) as s:
        stub = vgrpc.VllmEngineStub(s.channel)
        call = stub.Generate(vgen(stream=True, max_tokens=60, ignore_eos=True, **GREEDY))
        assert next(call).HasField("chunk")
        s.call(_begin_drain(s.server))
        health = stub.HealthCheck(vpb.HealthCheckRequest())
        assert not health.healthy and "draining" in health.message
        with pytest.raises(grpc.RpcError) as ei:
            list(stub.Generate(vgen(max_tokens=2)))
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
        assert list(call)[-1].complete.finish_reason == "length"  # the one in flight finishes


async def _begin_drain(server):
    server.begin_drain(30.0)


def test_model_info_reports_generation_config_sampling_defaults():
    import json

    make = fake_engine_factory(num_blocks=16)

    def factory():
        engine = make()
        engine.config.model_config.generation_defaults = {"temperature": 0.6, "top_k": 20, "max_tokens": 50}
        return engine
    with ServerThread(factory) as s:
        info = vgrpc.VllmEngineStub(s.channel).GetModelInfo(vpb.GetModelInfoRequest())
        assert json.loads(info.default_sampling_params_json) == {"temperature": 0.6, "top_k": 20}
