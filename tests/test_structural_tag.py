"""Structural tags (xgrammar's format, as vLLM and the SMG gateway send them): the translation into
llguidance grammar, what the compiled matcher accepts and refuses token by token (SmolLM2's
tokenizer with tool-call special tokens added), the tags SMG builds for its tool parsers, errors,
and one request through the vLLM door."""
from __future__ import annotations

import copy
import json

import grpc
import llguidance
import pytest

from llmsvc.sampling_params import StructuredOutputsParams as SO
from llmsvc.sampling_params_error import SamplingParamsError
from llmsvc.structured import ConstraintError
from llmsvc.structured.compiler import build_tokenizer, compile_matcher, grammar_text

SPECIALS = ["[TOOL_CALLS]", "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
            "<|tool_call_argument_begin|>", "<|tool_call_end|>", "<|open|>", "<|close|>", "<|sep|>",
            "<|content_invoke_tool_json|>", "<|end_message|>"]
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"], "additionalProperties": False}
DAYS = {"type": "object", "properties": {"days": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["days"], "additionalProperties": False}
TOOLS = [("get_weather", CITY), ("get_time", DAYS)]


@pytest.fixture(scope="module")
def tok():
    from tests.engine_fakes import smollm2_tokenizer
    hf = copy.deepcopy(smollm2_tokenizer())
    hf.add_special_tokens({"additional_special_tokens": SPECIALS})
    return build_tokenizer(hf, len(hf), [hf.eos_token_id])


def st(fmt: dict) -> SO:
    return SO(structural_tag=json.dumps({"type": "structural_tag", "format": fmt}))


def run(tok, so: SO, text: str) -> str:
    """'complete' (accepted, may end here), 'prefix' (accepted, must go on) or 'rejected'."""
    m = compile_matcher(tok, so)
    for t in tok.tokenize_str(text, parse_special=True):
        if not m.consume_token(t):
            return "rejected"
    return "complete" if m.is_accepting() else "prefix"


def tag(begin, content, end):
    return {"begin": begin, "content": content, "end": end}


def js(schema):
    return {"type": "json_schema", "json_schema": schema}


FUNCS = {"type": "triggered_tags", "triggers": ["<function="],
         "tags": [tag(f"<function={n}>", js(s), "</function>") for n, s in TOOLS]}
CALL_W, CALL_T = '<function=get_weather>{"city": "Paris"}</function>', '<function=get_time>{"days": 3}</function>'

# (format, output, outcome)
CASES = [
    ({"type": "const_string", "value": "Hi!"}, "Hi!", "complete"),
    ({"type": "const_string", "value": "Hi!"}, "Ho", "rejected"),
    (js(CITY), '{"city": "Rome"}', "complete"),
    (js(CITY), '{"city":"Rome"}', "rejected"),  # laid out as the json kind lays it out
    (js(CITY), '{"town": "Rome"}', "rejected"),
    ({"type": "regex", "pattern": "[0-9]{2}/[a-z]+"}, "12/ab", "complete"),
    ({"type": "regex", "pattern": "[0-9]{2}/[a-z]+"}, "1a", "rejected"),
    ({"type": "grammar", "grammar": 'root ::= "yes" | "no"'}, "no", "complete"),
    ({"type": "grammar", "grammar": 'start: "yes" | "no"'}, "maybe", "rejected"),
    ({"type": "any_text"}, "anything <at> all\n", "complete"),
    ({"type": "any_text", "excludes": ["STOP"]}, "go on STOP", "rejected"),
    ({"type": "sequence", "elements": [{"type": "const_string", "value": "A:"},
                                       {"type": "regex", "pattern": "[0-9]+"}]}, "A:42", "complete"),
    ({"type": "sequence", "elements": [{"type": "any_text"}, {"type": "const_string", "value": "END"}]},
     "free text END", "complete"),
    ({"type": "sequence", "elements": [{"type": "any_text"}, {"type": "const_string", "value": "END"}]},
     "free text END more", "rejected"),  # the text ends at the literal's first occurrence
    ({"type": "or", "elements": [{"type": "const_string", "value": "a"}, js(DAYS)]}, '{"days": 2}', "complete"),
    ({"type": "or", "elements": [{"type": "const_string", "value": "a"}, js(DAYS)]}, "b", "rejected"),
    ({"type": "optional", "content": {"type": "const_string", "value": "x"}}, "", "complete"),
    ({"type": "plus", "content": {"type": "const_string", "value": "ab"}}, "ababab", "complete"),
    ({"type": "plus", "content": {"type": "const_string", "value": "ab"}}, "", "prefix"),
    ({"type": "star", "content": {"type": "const_string", "value": "ab"}}, "aba", "prefix"),
    ({"type": "repeat", "min": 2, "max": 3, "content": {"type": "const_string", "value": "z"}}, "z", "prefix"),
    ({"type": "repeat", "min": 2, "max": 3, "content": {"type": "const_string", "value": "z"}}, "zzzz", "rejected"),
    ({"type": "tag", "begin": "<think>", "content": {"type": "any_text"}, "end": "</think>"},
     "<think>a </thin b</think>", "complete"),
    ({"type": "tag", "begin": "<think>", "content": {"type": "any_text"}, "end": "</think>"},
     "<think>a</think> b", "rejected"),  # free text inside a tag never holds its end
    (tag("<a>", js(DAYS), ["</a>", "</b>"]), '<a>{"days": 1}</b>', "complete"),  # a typeless object is a tag
    # triggered_tags: free text, a trigger forces one of its tags, free text again
    (FUNCS, "no call at all", "complete"),
    (FUNCS, f"Let me check. {CALL_W} and {CALL_T} done", "complete"),
    (FUNCS, "text <function=get_news>", "rejected"),
    (FUNCS, '<function=get_weather>{"days": 3}', "rejected"),
    (FUNCS, "text <functio", "complete"),
    (dict(FUNCS, at_least_one=True), "text first", "rejected"),
    (dict(FUNCS, at_least_one=True), f"{CALL_T} then text {CALL_W}", "complete"),
    (dict(FUNCS, at_least_one=True), "", "prefix"),
    (dict(FUNCS, stop_after_first=True), f"text {CALL_W}", "complete"),
    (dict(FUNCS, stop_after_first=True), f"text {CALL_W} more", "rejected"),
    (dict(FUNCS, stop_after_first=True), "only text", "complete"),
    (dict(FUNCS, at_least_one=True, stop_after_first=True), CALL_T, "complete"),
    (dict(FUNCS, at_least_one=True, stop_after_first=True), f"{CALL_T}{CALL_T}", "rejected"),
    (dict(FUNCS, excludes=["BAD"]), "a BAD word", "rejected"),
    # tags_with_separator: nothing but tags and separators
    ({"type": "tags_with_separator", "tags": FUNCS["tags"], "separator": ", "}, "", "complete"),
    ({"type": "tags_with_separator", "tags": FUNCS["tags"], "separator": ", "}, f"{CALL_W}, {CALL_T}", "complete"),
    ({"type": "tags_with_separator", "tags": FUNCS["tags"], "separator": ", "}, f"{CALL_W},{CALL_T}", "rejected"),
    ({"type": "tags_with_separator", "tags": FUNCS["tags"], "separator": ", "}, f"x{CALL_W}", "rejected"),
    ({"type": "tags_with_separator", "tags": FUNCS["tags"], "separator": ", ", "at_least_one": True}, "", "prefix"),
    ({"type": "tags_with_separator", "tags": FUNCS["tags"], "separator": ", ", "stop_after_first": True},
     f"{CALL_W}, ", "rejected"),
]


@pytest.mark.parametrize("fmt, text, outcome", CASES)
def test_each_format_accepts_what_it_describes(tok, fmt, text, outcome):
    assert run(tok, st(fmt), text) == outcome


def test_translation_is_lark_with_named_leaves():
    g = json.loads(grammar_text(st({"type": "sequence", "elements": [
        {"type": "tag", "begin": "<think>", "content": {"type": "any_text"}, "end": "</think>"}, js(CITY)]})))
    main, leaf = g["grammars"]
    assert main["lark_grammar"].startswith('start: "<think>" h')  # text and its end: one lazy lexeme
    assert "[lazy]" in main["lark_grammar"] and "@" + leaf["name"] in main["lark_grammar"]
    assert leaf["json_schema"]["x-guidance"]["item_separator"] == ", "  # the json kind's layout
    assert llguidance.LLMatcher.validate_grammar(json.dumps(g)) == ""


def test_special_token_strings_match_the_token_only(tok):
    so = st({"type": "triggered_tags", "triggers": ["<|tool_call_begin|>"],
             "tags": [tag("<|tool_call_begin|>f:0<|tool_call_argument_begin|>", js(DAYS), "<|tool_call_end|>")],
             "at_least_one": True})
    ok = '<|tool_call_begin|>f:0<|tool_call_argument_begin|>{"days": 2}<|tool_call_end|>'
    assert run(tok, so, ok) == "complete"
    m = compile_matcher(tok, so)
    spelled = tok.greedy_tokenize("<|tool_call_begin|>")
    assert len(spelled) > 1 and not m.consume_token(spelled[0])  # its spelling as text is not the token
    m = compile_matcher(tok, so)
    mask = int.from_bytes(m.compute_bitmask(), "little")
    (begin,) = tok.tokenize_str("<|tool_call_begin|>", parse_special=True)
    assert [t for t in range(tok.vocab_size) if mask >> t & 1] == [begin]  # at_least_one: the tag first
    # without a tokenizer (or where the model has no such token) the string is plain text
    assert "<[" not in json.loads(grammar_text(so))["grammars"][0]["lark_grammar"]
    assert "<[" in json.loads(grammar_text(so, tok))["grammars"][0]["lark_grammar"]


def test_legacy_structures_and_triggers(tok):
    so = SO(structural_tag=json.dumps({"type": "structural_tag", "triggers": ["<function="], "structures": [
        {"begin": f"<function={n}>", "schema": s, "end": "</function>"} for n, s in TOOLS]}))
    assert run(tok, so, f"Sure. {CALL_W} and {CALL_T}.") == "complete"
    assert run(tok, so, "<function=nope>") == "rejected"
    assert run(tok, so, "<function=get_time>{\"days\": 10}") == "rejected"


# ---- the tags SMG's tool parsers build (crates/tool_parser/src/parsers/*.rs), for TOOLS ------------
def smg_mistral(at_least_one):
    tags = [tag(f'{{"name": {json.dumps(n)}, "arguments": ', js(s), "}") for n, s in TOOLS]
    return {"format": {"type": "triggered_tags", "triggers": ["[TOOL_CALLS]"], "at_least_one": at_least_one,
                       "tags": [tag("[TOOL_CALLS] [", {"type": "tags_with_separator", "tags": tags, "separator": ", "},
                                    "]")]}}


def smg_kimik2(at_least_one):
    tags = []
    for i, (n, s) in enumerate(TOOLS):
        args = f"functions.{n}:{i}<|tool_call_argument_begin|>"
        tags += [tag(f"<|tool_calls_section_begin|><|tool_call_begin|>{args}", js(s), "<|tool_call_end|>"),
                 tag(f"<|tool_call_begin|>{args}", js(s), "<|tool_call_end|>")]
    return {"format": {"type": "triggered_tags", "triggers": ["<|tool_calls_section_begin|>", "<|tool_call_begin|>"],
                       "tags": tags, "at_least_one": at_least_one}}


def smg_kimi_k3(at_least_one):
    o, c, sep = "<|open|>", "<|close|>", "<|sep|>"

    def const(v):
        return {"type": "const_string", "value": v}

    def call(name, key, value):
        arg = {"type": "sequence", "elements": [const(f'{o}argument key="{key}" type="{value[0]}"{sep}'), value[1],
                                                const(f"{c}argument{sep}")]}
        return {"type": "sequence", "elements": [const(f'{o}call tool="{name}" index="'),
                                                 {"type": "regex", "pattern": "[1-9][0-9]*"}, const(f'"{sep}'),
                                                 {"type": "sequence", "elements": [arg]}, const(f"{c}call{sep}")]}
    calls = [call("get_weather", "city", ("string", {"type": "any_text", "excludes": [c, o, sep]})),
             {"type": "optional", "content": call("get_time", "days", ("number", js({"type": "integer"})))}]
    content = {"type": "plus", "content": {"type": "or", "elements": calls}}
    tags = [tag(f"{p}{o}tools{sep}", content, f"{c}tools{sep}") for p in ("", f"{c}think{sep}", f"{c}response{sep}")]
    return {"format": {"type": "triggered_tags", "triggers": [f"{o}tools{sep}", f"{c}think{sep}",
                                                              f"{c}response{sep}"],
                       "tags": tags, "at_least_one": at_least_one}}


def smg_inkling(at_least_one):
    tags = [tag(f'<|content_invoke_tool_json|>{{"name":{json.dumps(n)},"args":', js(s), "}<|end_message|>")
            for n, s in TOOLS]
    return {"format": {"type": "triggered_tags", "triggers": ["<|content_invoke_tool_json|>"], "tags": tags,
                       "at_least_one": at_least_one}}


W_ARGS, T_ARGS = '{"city": "Oslo"}', '{"days": 4}'
SMG = [
    (smg_mistral, f'[TOOL_CALLS] [{{"name": "get_weather", "arguments": {W_ARGS}}}, '
                  f'{{"name": "get_time", "arguments": {T_ARGS}}}]', '[TOOL_CALLS] [{"name": "get_news"'),
    (smg_kimik2, f"<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
                 f"{W_ARGS}<|tool_call_end|><|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>"
                 f"{T_ARGS}<|tool_call_end|><|tool_calls_section_end|>",
     f"<|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>{W_ARGS}"),
    (smg_kimi_k3, '<|close|>think<|sep|><|open|>tools<|sep|><|open|>call tool="get_weather" index="1"<|sep|>'
                  '<|open|>argument key="city" type="string"<|sep|>Oslo "north"<|close|>argument<|sep|>'
                  '<|close|>call<|sep|><|close|>tools<|sep|>',
     '<|open|>tools<|sep|><|open|>call tool="get_news"'),
    (smg_inkling, f'<|content_invoke_tool_json|>{{"name":"get_time","args":{T_ARGS}}}<|end_message|>',
     '<|content_invoke_tool_json|>{"name":"get_time","args":{"days": 0}'),
]


@pytest.mark.parametrize("build, call, bad", SMG, ids=[b.__name__ for b, _, _ in SMG])
def test_smg_tool_call_tags(tok, build, call, bad):
    auto, required = (SO(structural_tag=json.dumps(build(x))) for x in (False, True))
    assert run(tok, required, call) == "complete"  # tool_choice "required": the call, nothing before it
    assert run(tok, required, "Sure, " + call) == "rejected"
    assert run(tok, auto, "Sure, " + call) == "complete"  # tool_choice "auto": text, then calls
    assert run(tok, auto, "Just text.") == "complete"
    assert run(tok, required, bad) == "rejected"
    # a trigger that is a special token and then more (Kimi-K3's "<|open|>tools<|sep|>") keeps its
    # special token out of free text, so it starts a tag there too (it was not enforced)
    assert run(tok, auto, bad) == "rejected"


# ---- errors -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, why", [
    ("[1]", "must be a JSON object"),
    ("{not json", "not valid JSON"),
    ('{"type": "other", "format": {}}', '"structural_tag"'),
    ('{"type": "structural_tag"}', 'must have a "format" object'),
    ('{"structures": {}, "triggers": []}', '"structures" and "triggers" lists'),
])
def test_verify_names_the_field(text, why):
    with pytest.raises(SamplingParamsError) as ei:
        SO(structural_tag=text)
    assert ei.value.field == "structured_outputs.structural_tag" and why in str(ei.value)


@pytest.mark.parametrize("fmt, reason, words", [
    ({"type": "nope"}, "INVALID_GRAMMAR", "format: format type 'nope' is not supported"),
    ({"type": "token", "token": 5}, "INVALID_GRAMMAR", "'token' is not supported"),
    ({"type": "sequence", "elements": []}, "INVALID_GRAMMAR", 'format: needs a non-empty "elements"'),
    ({"type": "or", "elements": [{"type": "const_string"}]}, "INVALID_GRAMMAR", 'format.elements[0]: needs "value"'),
    (dict(FUNCS, tags=[tag("<tool>", js(CITY), "</tool>")]), "INVALID_GRAMMAR",
     "format.tags[0]: begin '<tool>' must start with exactly one trigger"),
    (tag("<a>", js({"type": "strnig"}), "</a>"), "INVALID_SCHEMA", "format.content.json_schema: is not a usable"),
    (tag("<a>", js({"not": {}}), "</a>"), "UNSUPPORTED_SCHEMA_FEATURE", "format.content.json_schema: uses a JSON"),
    (tag("<a>", js(False), "</a>"), "INVALID_SCHEMA", "is false"),
    ({"type": "regex", "pattern": "(a"}, "INVALID_REGEX", "format.pattern: is not a valid regular"),
    ({"type": "grammar", "grammar": "root ::= x"}, "INVALID_GRAMMAR", "format.grammar:"),
    ({"type": "any_text", "max_tokens": 5}, "INVALID_GRAMMAR", "budgets are not supported"),
    (js(CITY) | {"style": "qwen_xml"}, "INVALID_GRAMMAR", '"style": "json"'),
    ({"type": "tag", "begin": {"type": "token", "token": "<x>"}, "content": js(CITY), "end": "x"},
     "INVALID_GRAMMAR", "token formats are not supported"),
])
def test_compile_errors_name_the_part(tok, fmt, reason, words):
    with pytest.raises(ConstraintError) as ei:
        compile_matcher(tok, st(fmt))
    e = ei.value
    assert (e.kind, e.field, e.reason) == ("structural_tag", "structured_outputs.structural_tag", reason)
    assert words in e.message, e.message


# ---- through the vLLM door ----------------------------------------------------------------------------
def test_vllm_door_generates_under_a_structural_tag():
    from llmsvc.server.vllm_engine.proto import vllm_engine_pb2 as vpb
    from llmsvc.server.vllm_engine.proto import vllm_engine_pb2_grpc as vgrpc
    from tests.reliability_utils import rpc_details
    from tests.server_harness import ServerThread, fake_engine_factory, tiny_tokenizer

    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "w": {"enum": ["yes", "no"]}},
              "required": ["n", "w"], "additionalProperties": False}
    structural = json.dumps({"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": ["<|im_start|>"], "at_least_one": True, "stop_after_first": True,
        "tags": [tag("<|im_start|>call ", js(schema), "<|im_end|>")]}})
    s = ServerThread(fake_engine_factory(num_blocks=64, max_model_len=256))
    try:
        door = vgrpc.VllmEngineStub(s.channel)
        req = vpb.GenerateRequest(tokenized=vpb.TokenizedInput(input_ids=list(b"call a tool")),
                                  sampling_params=vpb.SamplingParams(temperature=0.0, max_tokens=60,
                                                                     skip_special_tokens=False,
                                                                     structural_tag=structural))
        (out,) = list(door.Generate(req))
        assert out.complete.finish_reason == "stop"
        text = tiny_tokenizer().decode(list(out.complete.output_ids), skip_special_tokens=False)
        assert text.startswith("<|im_start|>call ") and text.endswith("<|im_end|>"), text
        call = json.loads(text[len("<|im_start|>call "):-len("<|im_end|>")])
        assert set(call) == {"n", "w"} and 0 <= call["n"] <= 99 and call["w"] in ("yes", "no")
        bad = vpb.GenerateRequest(tokenized=vpb.TokenizedInput(input_ids=[104]), sampling_params=vpb.SamplingParams(
            max_tokens=4, structural_tag=json.dumps({"format": {"type": "tag", "begin": "<", "content": js(
                {"type": "strnig"}), "end": ">"}})))
        with pytest.raises(grpc.RpcError) as ei:
            list(door.Generate(bad))
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        (violation,) = rpc_details(ei.value)["BadRequest"].field_violations
        assert violation.field == "sampling_params.structural_tag"
        assert "format.content.json_schema" in ei.value.details()
        # over the size every constraint kind is held to (1 MiB of text)
        huge = vpb.GenerateRequest(tokenized=vpb.TokenizedInput(input_ids=[104]), sampling_params=vpb.SamplingParams(
            max_tokens=4, structural_tag=json.dumps({"format": {"type": "const_string", "value": "x" * (1 << 20)}})))
        with pytest.raises(grpc.RpcError) as ei:
            list(door.Generate(huge))
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert rpc_details(ei.value)["ErrorInfo"].reason == "CONSTRAINT_TOO_LARGE"
    finally:
        s.stop()


# ---- against xgrammar's semantics: shapes a differential run found wrong --------------------------
def seq(*elements):
    return {"type": "sequence", "elements": list(elements)}


def const(v):
    return {"type": "const_string", "value": v}


TEXT = {"type": "any_text"}


@pytest.mark.parametrize("fmt, text, outcome", [
    # free text then a tag: the text ends at the tag's begin (it ran on and never ended)
    (seq(TEXT, tag("<a>", TEXT, "</a>")), "x<a>y</a>", "complete"),
    # optional / plus / star of free text is free text (the tag could never close)
    (tag("<a>", {"type": "optional", "content": TEXT}, "</a>"), "<a>x</a>", "complete"),
    (tag("<a>", {"type": "star", "content": TEXT}, "</a>"), "<a></a>", "complete"),
    # an alternative holding free text, then a literal: each alternative takes the literal
    (tag("<a>", seq({"type": "or", "elements": [TEXT, const("q")]}, const("!")), "</a>"), "<a>q!</a>", "complete"),
    (tag("<a>", seq({"type": "or", "elements": [TEXT, const("q")]}, const("!")), "</a>"), "<a>zz!</a>", "complete"),
    # the string after the text starts with a special token: text never holds that token
    (seq(TEXT, const("<|tool_call_end|>")), "abc<|tool_call_end|>", "complete"),
    (tag("<|open|>think<|sep|>", TEXT, "<|close|>think<|sep|>"), "<|open|>think<|sep|>a<|close|>think<|sep|>",
     "complete"),
    (tag("<|open|>think<|sep|>", TEXT, "<|close|>think<|sep|>"), "<|open|>think<|sep|>a<|close|>think<|sep|>b",
     "rejected"),
    # a plain exclude held in a special token's text keeps the token out ("<|": every <|...|>)
    ({"type": "any_text", "excludes": ["<|"]}, "a<|tool_call_end|>b", "rejected"),
    ({"type": "any_text", "excludes": ["<|"]}, "a < | b", "complete"),
    # repeat of at most 0: nothing; an empty const_string: nothing
    (seq(const("A"), {"type": "repeat", "min": 0, "max": 0, "content": const("B")}), "A", "complete"),
    (seq(const(""), const("A")), "A", "complete"),
])
def test_shapes_that_agree_with_xgrammar_now(tok, fmt, text, outcome):
    assert run(tok, st(fmt), text) == outcome


@pytest.mark.parametrize("fmt", [
    seq(TEXT, js(CITY)),  # where would the text end?
    {"type": "plus", "content": seq(const("-"), TEXT)},  # text followed by its own repetition
])
def test_free_text_followed_by_no_known_string_is_refused(tok, fmt):
    with pytest.raises(ConstraintError, match="free text must be followed by a string") as ei:
        compile_matcher(tok, st(fmt))
    assert ei.value.reason == "INVALID_GRAMMAR"


def test_an_excluded_special_tokens_spelling_is_excluded_as_text(tok):
    # the spelling as plain text: tokenized in pieces, or the tokenizer would find the special token
    ids = [t for piece in ("a <", "|tool_call_end", "|> b") for t in tok.tokenize_str(piece, parse_special=False)]
    assert all(compile_matcher(tok, st({"type": "any_text", "excludes": ["zzz"]})).consume_token(t) for t in ids)
    m = compile_matcher(tok, st({"type": "any_text", "excludes": ["<|tool_call_end|>"]}))
    assert not all(m.consume_token(t) for t in ids)
