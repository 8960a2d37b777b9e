"""Chat prompts as vLLM's chat API takes them: tools, tool calls and their answers, names, extra
template variables and a continued final message reach the chat template (rendered here by a
template that prints each of them); bad combinations are INVALID_ARGUMENT naming the field."""
from __future__ import annotations

import grpc
import pytest

from llmsvc.client import Client
from llmsvc.client.errors import LlmsvcError
from llmsvc.client.request import build_generate_request, build_tokenize_request
from llmsvc.server.errors import ServiceError
from llmsvc.server.prompt import render_chat
from llmsvc.v1 import llmsvc_pb2 as pb
from tests.server_harness import ServerThread, fake_engine_factory, tiny_tokenizer

TEMPLATE = (
    "{% if tools %}TOOLS {% for t in tools %}{{ t.function.name }}:{{ t.function.parameters | tojson }};"
    "{% endfor %}\n{% endif %}"
    "{% for m in messages %}[{{ m.role }}{% if m.name %} name={{ m.name }}{% endif %}"
    "{% if m.tool_call_id %} for={{ m.tool_call_id }}{% endif %}]{{ m.content }}"
    "{% for c in m.tool_calls or [] %}CALL {{ c.id }} {{ c.function.name }} {{ c.function.arguments | tojson }}"
    "{% endfor %}[end]\n{% endfor %}"
    "{% if enable_thinking is defined and not enable_thinking %}NOTHINK\n{% endif %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}")
WEATHER = {"type": "function", "function": {"name": "weather", "description": "the weather in a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}
CONVERSATION = [
    {"role": "system", "content": "be brief", "name": "ops"},
    {"role": "user", "content": "weather in Oslo?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}]},
    {"role": "tool", "content": "-3 C", "tool_call_id": "c1"},
]


@pytest.fixture(scope="module")
def tokenizer():
    tok = tiny_tokenizer()
    tok.chat_template = TEMPLATE
    return tok


def render(tokenizer, messages, **kw) -> str:
    return render_chat(tokenizer, build_generate_request(messages=messages, **kw).chat)


def test_tools_tool_calls_names_and_template_kwargs_reach_the_template(tokenizer):
    text = render(tokenizer, CONVERSATION, tools=[WEATHER], chat_template_kwargs={"enable_thinking": False})
    assert text == (
        # keys sorted (a Struct keeps no order); trim_blocks eats the "\n"
        'TOOLS weather:{"properties": {"city": {"type": "string"}}, "type": "object"};'
        "[system name=ops]be brief[end]\n"
        "[user]weather in Oslo?[end]\n"
        '[assistant]CALL c1 weather {"city": "Oslo"}[end]\n'  # arguments as an object, not a string
        "[tool for=c1]-3 C[end]\n"
        "NOTHINK\n[assistant]")
    assert render(tokenizer, CONVERSATION[1:2]) == "[user]weather in Oslo?[end]\n[assistant]"


def test_whole_numbers_in_tools_and_template_kwargs_stay_integers(tokenizer):
    # a Struct stores doubles: the schema read "maximum": 10.0 and a template's range(n) failed
    days = {"type": "function", "function": {"name": "forecast", "parameters": {
        "type": "object", "properties": {"days": {"type": "integer", "minimum": 1, "maximum": 10,
                                                  "multipleOf": 0.5}}}}}
    text = render(tokenizer, CONVERSATION[1:2], tools=[days])
    assert '"maximum": 10, "minimum": 1, "multipleOf": 0.5' in text
    tok = tiny_tokenizer()
    tok.chat_template = "{% for i in range(n) %}{{ i }}{% endfor %}{{ messages[0].content }}"
    assert render(tok, CONVERSATION[1:2], chat_template_kwargs={"n": 3}) == "012weather in Oslo?"


@pytest.mark.parametrize("knows_developer", [False, True])
def test_developer_messages_are_system_messages_for_templates_without_the_role(knows_developer):
    # as vLLM: the developer turn becomes a system turn, merged with any other into the first
    tok = tiny_tokenizer()
    tok.chat_template = TEMPLATE + ("{# 'developer' #}" if knows_developer else "")
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                {"role": "developer", "content": "answer in French"}]
    text = render(tok, messages, add_generation_prompt=False)
    if knows_developer:
        assert text == "[system]be brief[end]\n[user]hi[end]\n[developer]answer in French[end]\n"
    else:
        assert text == "[system]be brief\n\nanswer in French[end]\n[user]hi[end]\n"


def test_continue_final_message_leaves_the_last_turn_open(tokenizer):
    messages = [{"role": "user", "content": "count"}, {"role": "assistant", "content": "one, two,"}]
    assert render(tokenizer, messages, continue_final_message=True) == "[user]count[end]\n[assistant]one, two,"
    assert render(tokenizer, messages) == "[user]count[end]\n[assistant]one, two,[end]\n[assistant]"


@pytest.mark.parametrize("kw, field, why", [
    (dict(continue_final_message=True, add_generation_prompt=True), "chat.continue_final_message", "cannot be"),
    (dict(chat_template_kwargs={"tokenize": True, "messages": []}), "chat.chat_template_kwargs",
     "messages, tokenize cannot be set"),
    (dict(tools=[WEATHER] * 129), "chat.tools", "at most 128"),
])
def test_bad_chat_options_name_the_field(tokenizer, kw, field, why):
    with pytest.raises(ServiceError) as ei:
        render(tokenizer, CONVERSATION[1:2], **kw)
    assert ei.value.code == grpc.StatusCode.INVALID_ARGUMENT and ei.value.field == field and why in ei.value.message


def test_tool_call_arguments_must_be_a_json_object(tokenizer):
    msg = pb.ChatMessage(role="assistant", content="")
    msg.tool_calls.add(id="c", name="f", arguments="[1, 2]")
    with pytest.raises(ServiceError, match="must be a JSON object") as ei:
        render(tokenizer, [pb.ChatMessage(role="user", content="x"), msg])
    assert ei.value.field == "chat.messages[1].tool_calls[0].arguments"
    msg.tool_calls[0].arguments = "{oops"
    with pytest.raises(ServiceError, match="not JSON"):
        render(tokenizer, [pb.ChatMessage(role="user", content="x"), msg])


def test_client_builds_the_chat_fields():
    req = build_generate_request(messages=CONVERSATION, tools=[WEATHER], chat_template_kwargs={"x": 1},
                                 continue_final_message=True)
    assert req.chat.messages[2].tool_calls[0].name == "weather" and req.chat.messages[3].tool_call_id == "c1"
    assert req.chat.messages[0].name == "ops" and req.chat.continue_final_message
    assert req.chat.tools[0]["function"]["name"] == "weather" and req.chat.chat_template_kwargs["x"] == 1
    # arguments given as a dict are sent as JSON text
    d = build_generate_request(messages=[{"role": "assistant", "tool_calls": [
        {"id": "a", "function": {"name": "f", "arguments": {"k": [1]}}}]}])
    assert d.chat.messages[0].tool_calls[0].arguments == '{"k": [1]}'
    with pytest.raises(TypeError, match="apply to chat messages only"):
        build_generate_request("text", tools=[WEATHER])
    tok = build_tokenize_request(messages=CONVERSATION[1:2], continue_final_message=True, add_generation_prompt=False)
    assert tok.chat.continue_final_message and tok.chat.HasField("add_generation_prompt")


def test_client_joins_openai_text_content_parts_as_the_offline_chat_does():
    parts = [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]
    req = build_generate_request(messages=[{"role": "user", "content": parts}, ("user", parts)])
    assert [m.content for m in req.chat.messages] == ["Hi\nthere"] * 2
    with pytest.raises(ValueError, match="must be text parts .* got 'image_url'"):
        build_generate_request(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])


def test_over_grpc_tokenize_and_generate_take_the_chat_fields():
    with ServerThread(fake_engine_factory(max_model_len=256)) as srv, Client(srv.address, timeout=30) as c:
        messages = [{"role": "user", "content": "count"}, {"role": "assistant", "content": "one,"}]
        open_ids = list(c.tokenize(messages=messages, continue_final_message=True).token_ids)
        closed_ids = list(c.tokenize(messages=messages).token_ids)
        assert c.detokenize(open_ids, skip_special_tokens=False).endswith("assistant\none,")
        assert closed_ids[:len(open_ids)] == open_ids and len(closed_ids) > len(open_ids)
        out = c.generate(messages=messages, continue_final_message=True, max_tokens=2, tools=[WEATHER],
                         output={"prompt_token_ids": True})
        assert list(out.prompt.token_ids) == open_ids and len(out.token_ids) == 2
        with pytest.raises(LlmsvcError) as ei:
            c.generate(messages=messages, continue_final_message=True, add_generation_prompt=True, max_tokens=2)
        assert ei.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert ei.value.field_violations[0][0] == "chat.continue_final_message"


def test_llm_chat_takes_the_same_options(tmp_path):
    from llmsvc import LLM, SamplingParams
    from tests.server_harness import make_tiny_served_model_dir

    llm = LLM(model=make_tiny_served_model_dir(tmp_path), chat_template=TEMPLATE, block_size=4,
              num_kv_blocks_override=64)
    try:
        tok = llm.get_tokenizer()
        params = SamplingParams(max_tokens=1, temperature=0.0)
        (out,) = llm.chat(CONVERSATION, params, use_tqdm=False, tools=[WEATHER],
                          chat_template_kwargs={"enable_thinking": False})
        assert tok.decode(out.prompt_token_ids) == (
            'TOOLS weather:{"type": "object", "properties": {"city": {"type": "string"}}};'  # the caller's key order
            "[system name=ops]be brief[end]\n[user]weather in Oslo?[end]\n"
            '[assistant]CALL c1 weather {"city": "Oslo"}[end]\n[tool for=c1]-3 C[end]\nNOTHINK\n[assistant]')
        messages = [{"role": "user", "content": "count"}, {"role": "assistant", "content": "one, two,"}]
        (out,) = llm.chat(messages, params, use_tqdm=False, continue_final_message=True)
        assert tok.decode(out.prompt_token_ids) == "[user]count[end]\n[assistant]one, two,"
        with pytest.raises(ValueError, match="cannot be combined"):
            llm.chat(messages, params, continue_final_message=True, add_generation_prompt=True)
        # the method's own arguments win over the same names in chat_template_kwargs (a TypeError)
        (out,) = llm.chat(messages[:1], params, use_tqdm=False,
                          chat_template_kwargs={"add_generation_prompt": False, "tokenize": True})
        assert tok.decode(out.prompt_token_ids) == "[user]count[end]\n[assistant]"
    finally:
        llm.shutdown()
