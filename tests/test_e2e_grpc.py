"""End to end over loopback with the REAL engine, executor and model (tiny random Llama; the
default SmolLM2 model in the e2e-marked tests): the same server the CLI starts."""
from __future__ import annotations

import threading

import grpc
import pytest

from llmsvc.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from llmsvc.outputs import CompletionOutput, RequestOutput
from llmsvc.sampling_params import SamplingParams
from llmsvc.server.app import default_engine_factory
from llmsvc.server.responses import ResponseBuilder
from llmsvc.v1 import llmsvc_pb2 as pb
from tests.server_harness import EOS, ServerThread, make_tiny_served_model_dir
from tests.test_server import free_blocks_back

ST = pb.StoppingCriteria
GREEDY = pb.SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_served_model_dir(tmp_path_factory.mktemp("tiny"))


# --chat-template's text, replacing the tiny model's ChatML template
PLAIN_TEMPLATE = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}>{% endif %}"


@pytest.fixture(scope="module")
def tiny(tiny_dir, tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "plain.jinja"
    template.write_text(PLAIN_TEMPLATE)
    config = EngineConfig(model_config=ModelConfig(model=tiny_dir, served_name="tiny-llama", max_model_len=256,
                                                   chat_template=str(template)),
                          cache_config=CacheConfig(block_size=16, num_kv_blocks_override=64),
                          scheduler_config=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256),
                          device="cpu", log_stats_interval_s=0.0)
    s = ServerThread(default_engine_factory(config))
    yield s
    s.stop()


def test_stream_equals_unary_greedy(tiny):
    req = dict(text="hello world", sampling=GREEDY, stopping=ST(max_tokens=24, ignore_eos=True))
    msgs = list(tiny.stub.Generate(pb.GenerateRequest(stream=True, **req)))
    (final,) = list(tiny.stub.Generate(pb.GenerateRequest(**req)))
    assert "".join(m.text for m in msgs) == final.text
    assert [t for m in msgs for t in m.token_ids] == list(final.token_ids) and len(final.token_ids) == 24
    assert final.finish.reason == pb.FinishInfo.REASON_LENGTH


def test_model_info_names_the_model(tiny, tiny_dir):
    info = tiny.stub.GetModelInfo(pb.GetModelInfoRequest())
    assert (info.model_id, info.served_model_name) == (tiny_dir, "tiny-llama")
    assert info.architecture == "LlamaForCausalLM" and info.max_model_len == 256


def test_chat_template_option_replaces_the_models(tiny):
    chat = pb.ChatPrompt(messages=[pb.ChatMessage(role="user", content="hi")])
    ids = tiny.stub.Tokenize(pb.TokenizeRequest(chat=chat)).token_ids
    text = tiny.stub.Detokenize(pb.DetokenizeRequest(token_ids=ids, skip_special_tokens=False)).text
    assert text == "[user] hi\n>"  # not the model's own "<|im_start|>user\nhi<|im_end|>..."
    (m,) = list(tiny.stub.Generate(pb.GenerateRequest(chat=chat, stopping=ST(max_tokens=2))))
    assert m.prompt.num_prompt_tokens == len(ids) and m.finish.usage.completion_tokens == 2


def test_first_message_before_last_token(tiny):
    call = tiny.stub.Generate(pb.GenerateRequest(text="a long one", stream=True, sampling=GREEDY,
                                                 stopping=ST(max_tokens=200, ignore_eos=True)))
    first = next(call)
    assert not first.HasField("finish") and len(first.token_ids) < 200
    rest = list(call)
    assert rest[-1].num_output_tokens == 200


def test_sixteen_concurrent_streams(tiny):
    prompts = [f"prompt number {i}" for i in range(16)]
    expected = [list(tiny.stub.Generate(pb.GenerateRequest(text=p, sampling=GREEDY,
                                                           stopping=ST(max_tokens=12, ignore_eos=True))))[0].text
                for p in prompts]
    got = [None] * 16

    def worker(i):
        got[i] = "".join(m.text for m in tiny.stub.Generate(pb.GenerateRequest(
            text=prompts[i], stream=True, sampling=GREEDY, stopping=ST(max_tokens=12, ignore_eos=True))))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert got == expected
    free_blocks_back(tiny)


def test_cancel_and_abort_return_all_blocks(tiny):
    call = tiny.stub.Generate(pb.GenerateRequest(text="x", stream=True, stopping=ST(max_tokens=220, ignore_eos=True)))
    next(call)
    call.cancel()
    free_blocks_back(tiny)
    call = tiny.stub.Generate(pb.GenerateRequest(request_id="ab", text="y", stream=True,
                                                 stopping=ST(max_tokens=220, ignore_eos=True)))
    next(call)
    assert list(tiny.stub.Abort(pb.AbortRequest(request_ids=["ab"])).aborted) == ["ab"]
    assert list(call)[-1].finish.reason == pb.FinishInfo.REASON_ABORTED
    info = free_blocks_back(tiny)
    assert info.num_kv_blocks == 64


def test_prompt_too_long_over_the_wire(tiny):
    with pytest.raises(grpc.RpcError) as ei:
        list(tiny.stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5] * 256))))
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    (m,) = list(tiny.stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5] * 300), truncate_prompt_tokens=250,
                                                      stopping=ST(ignore_eos=True))))
    assert m.prompt.num_prompt_tokens == 250 and m.finish.reason == pb.FinishInfo.REASON_CONTEXT
    assert len(m.token_ids) == 6


@pytest.mark.e2e
def test_default_model_chat_and_stop(tmp_path):
    config = EngineConfig(model_config=ModelConfig(max_model_len=512),
                          cache_config=CacheConfig(kv_cache_memory_bytes=64 << 20), device="cpu")
    with ServerThread(default_engine_factory(config)) as s:
        info = s.stub.GetModelInfo(pb.GetModelInfoRequest())
        assert info.has_chat_template and info.vocab_size == 49152
        # the GGUF the model came from, not the cache directory it was converted into
        assert info.model_id.endswith(".gguf") and info.served_model_name == "SmolLM2-135M-Instruct"
        chat = pb.ChatPrompt(messages=[pb.ChatMessage(role="user", content="What is the capital of France?")])
        msgs = list(s.stub.Generate(pb.GenerateRequest(chat=chat, stream=True, sampling=GREEDY,
                                                       stopping=ST(max_tokens=32))))
        text = "".join(m.text for m in msgs)
        assert "Paris" in text
        (m,) = list(s.stub.Generate(pb.GenerateRequest(chat=chat, sampling=GREEDY,
                                                       stopping=ST(max_tokens=32, stop=["Paris"]))))
        assert m.finish.reason == pb.FinishInfo.REASON_STOP and m.finish.stop_string == "Paris"
        assert "Paris" not in m.text and text.startswith(m.text)
        free_blocks_back(s)


@pytest.mark.parametrize("stream", [True, False])
def test_finish_names_the_eos_or_the_stop_token(tiny, stream):
    # FinishInfo.matched: an EOS is eos_token_id, a requested stop token stop_token_id (the engine
    # reports an EOS with stop_reason None, as vLLM; the server must still name it)
    def finish(**sampling):
        req = pb.GenerateRequest(text="hello", stream=stream, sampling=pb.SamplingParams(temperature=0.0, **sampling),
                                 stopping=ST(max_tokens=8, stop_token_ids=[7]))
        (f,) = [m.finish for m in tiny.stub.Generate(req, timeout=60) if m.HasField("finish")]
        return f
    f = finish(logit_bias={EOS: 100.0})
    assert f.reason == pb.FinishInfo.REASON_STOP and f.WhichOneof("matched") == "eos_token_id" and f.eos_token_id == EOS
    f = finish(logit_bias={7: 100.0})
    assert f.reason == pb.FinishInfo.REASON_STOP and f.WhichOneof("matched") == "stop_token_id" and f.stop_token_id == 7


def test_finish_names_an_eos_that_offline_reports_as_a_stop_token():
    # the model's EOS ids other than the tokenizer's keep their id as stop_reason offline (vLLM);
    # FinishInfo still says it was an EOS
    out = RequestOutput("r", "hi", [1, 2], [], finished=True)
    comp = CompletionOutput(0, "", [5], finish_reason="stop", stop_reason=5, eos_token_id=5)
    f = ResponseBuilder("r", pb.GenerateRequest(), SamplingParams(), None).finish_info(out, comp)
    assert f.WhichOneof("matched") == "eos_token_id" and f.eos_token_id == 5
