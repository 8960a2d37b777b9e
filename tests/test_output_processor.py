"""OutputProcessor: stop strings, output kinds, n > 1, logprobs (real SmolLM2 tokenizer)."""
from __future__ import annotations

import itertools

import pytest

from engine_fakes import smollm2_tokenizer
from llmsvc.core.core_output import EngineCoreOutput
from llmsvc.engine.output_processor import OutputProcessor, ParentRequest
from llmsvc.sampling_params import RequestOutputKind, SamplingParams
from llmsvc.wire import SampleLogprobs

DELTA, CUMULATIVE, FINAL = RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY


@pytest.fixture(scope="module")
def tok():
    return smollm2_tokenizer()


def drive(tok, text, params, *, finish="length", stop_reason=None, extra_ids=(), rid="r", stream_interval=1):
    """Feed the ids of `text` one per step; returns (outputs, step index where a stop string hit)."""
    op = OutputProcessor(tok, stream_interval)
    prompt = tok.encode("Tell me:")
    op.add_request(ParentRequest(rid, "Tell me:", prompt, params, tok, 0.0, op.stream_interval))
    ids = tok.encode(text) + list(extra_ids)
    outs, stopped_at = [], None
    for k, t in enumerate(ids):
        last = k == len(ids) - 1
        co = EngineCoreOutput(rid, [t], finish_reason=finish if last else None,
                              stop_reason=stop_reason if last else None)
        ros, stop_ids = op.process_outputs([co])
        outs += ros
        if stop_ids:
            assert stop_ids == [rid] and stopped_at is None
            stopped_at = k
            break
    assert not op.has_unfinished()
    return outs, stopped_at, ids


def texts(outs):
    return [o.outputs[0].text for o in outs]


def test_stop_string_across_tokens_never_leaks(tok):
    text = "The quick brown fox jumps over the lazy dog"
    params = SamplingParams(stop=["fox jum"], output_kind=DELTA)
    outs, stopped_at, ids = drive(tok, text, params)
    assert stopped_at is not None and stopped_at < len(ids) - 1
    final = outs[-1].outputs[0]
    assert final.finish_reason == "stop" and final.stop_reason == "fox jum"
    assert "".join(texts(outs)) == "The quick brown "
    assert all("fox" not in t for t in texts(outs))  # the possible prefix was held back
    # token ids are never held back: every id up to the stop is reported
    assert sum((o.outputs[0].token_ids for o in outs), []) == ids[:stopped_at + 1]


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("min_tokens", [0, 4])
def test_several_tokens_in_one_step_stop_where_one_at_a_time_would(tok, include, min_tokens):
    # accepted drafts bring several tokens in one core output: none past the token that
    # completes the stop string is kept, nor its logprob, just as when each comes in its own step
    text = "The quick brown fox jumps over the lazy dog and runs away"
    params = dict(stop=["fox jum"], include_stop_str_in_output=include, min_tokens=min_tokens, logprobs=0)
    one_by_one, stopped_at, ids = drive(tok, text, SamplingParams(**params, output_kind=CUMULATIVE))
    op = OutputProcessor(tok)
    op.add_request(ParentRequest("r", "Tell me:", tok.encode("Tell me:"), SamplingParams(**params, output_kind=CUMULATIVE),
                                 tok, 0.0))
    lps = [SampleLogprobs(-0.5, 1, [], []) for _ in ids]
    outs, stop_ids = [], []
    for chunk in range(0, len(ids), 3):  # three tokens a step, the stop string inside one of them
        ros, stop_ids = op.process_outputs([EngineCoreOutput("r", ids[chunk:chunk + 3], lps[chunk:chunk + 3])])
        outs += ros
        if stop_ids:
            break
    assert stop_ids == ["r"] and stopped_at % 3 != 2  # the match was not at a step's end
    a, b = one_by_one[-1].outputs[0], outs[-1].outputs[0]
    assert (b.token_ids, b.text, b.finish_reason, b.stop_reason) == (a.token_ids, a.text, "stop", "fox jum")
    assert b.token_ids == ids[:stopped_at + 1] and len(b.logprobs) == len(b.token_ids)


def test_include_stop_str_in_output(tok):
    params = SamplingParams(stop=["fox jum"], include_stop_str_in_output=True, output_kind=CUMULATIVE)
    outs, _, _ = drive(tok, "The quick brown fox jumps over", params)
    assert outs[-1].outputs[0].text == "The quick brown fox jum"
    for a, b in zip(texts(outs), texts(outs)[1:]):
        assert b.startswith(a)  # cumulative outputs only grow


def test_held_prefix_released_when_not_a_stop(tok):
    params = SamplingParams(stop=["fox cat"], output_kind=DELTA)
    text = "a fox jumps, no fox cats"
    outs, stopped_at, _ = drive(tok, text, params)
    assert "".join(texts(outs)) == "a fox jumps, no "
    assert outs[-1].outputs[0].stop_reason == "fox cat"


def test_stop_string_inside_multibyte_text_and_held_text_flushed(tok):
    params = SamplingParams(stop=["世界"], output_kind=DELTA)
    outs, stopped_at, _ = drive(tok, "你好世界！再见", params)
    assert "".join(texts(outs)) == "你好"
    params = SamplingParams(stop=["😀!"], output_kind=DELTA)
    outs, stopped_at, _ = drive(tok, "smile 😀", params, finish="length")
    assert stopped_at is None
    assert "".join(texts(outs)) == "smile 😀"  # held back as a prefix, released at finish
    assert outs[-1].outputs[0].finish_reason == "length"


def test_the_stand_in_for_an_unfinished_character_never_matches_a_stop_string(tok):
    # max_tokens ends the output one byte token into a character: its text ends in U+FFFD, which
    # the model never produced; a stop string "\ufffd" used to match it and end the output "stop"
    partial = tok.encode("猫")[:-1]
    assert partial and tok.decode(partial).endswith("\ufffd")
    outs, stopped_at, _ = drive(tok, "cat:", SamplingParams(stop=["\ufffd"], output_kind=FINAL), extra_ids=partial)
    o = outs[-1].outputs[0]
    assert stopped_at is None and (o.finish_reason, o.stop_reason) == ("length", None)
    assert o.text == "cat:\ufffd"


def test_multiple_stop_strings_earliest_wins(tok):
    params = SamplingParams(stop=["dog", "brown"], output_kind=FINAL)
    outs, _, _ = drive(tok, "The quick brown fox jumps over the lazy dog", params)
    assert len(outs) == 1 and outs[0].finished
    assert outs[0].outputs[0].text == "The quick " and outs[0].outputs[0].stop_reason == "brown"


@pytest.mark.parametrize("stop, include, text, matched", [
    # both end inside one token ("versatile"): the one completed first ("sat") wins, as it would
    # arriving one character at a time (the one that started first used to)
    (["versatile", "sat"], False, "it is the most ver", "sat"),
    (["Red: This", ": Th"], False, "1. Red", ": Th"),
    (["Red: This", ": Th"], True, "1. Red: Th", ": Th"),
    (["most", "the most"], False, "it is the ", "most"),  # one end: the first in the list
    (["the most", "most"], False, "it is ", "the most"),
])
def test_overlapping_stop_strings_the_first_completed_wins(tok, stop, include, text, matched):
    params = SamplingParams(stop=stop, include_stop_str_in_output=include, output_kind=FINAL)
    source = "1. Red: This" if "Red" in stop[0] else "it is the most versatile"
    outs, _, _ = drive(tok, source, params)
    assert (outs[0].outputs[0].text, outs[0].outputs[0].stop_reason) == (text, matched)


def test_eos_not_in_text_but_in_token_ids(tok):
    outs, _, ids = drive(tok, "Bye now", SamplingParams(output_kind=FINAL), finish="stop", stop_reason=2,
                         extra_ids=[2])
    o = outs[0].outputs[0]
    assert o.text == "Bye now" and o.token_ids == ids and o.token_ids[-1] == 2
    assert o.stop_reason is None and o.eos_token_id == 2  # vLLM's stop_reason for an EOS: None
    outs, _, _ = drive(tok, "Bye now", SamplingParams(output_kind=FINAL, skip_special_tokens=False,
                                                     include_stop_str_in_output=True),
                       finish="stop", stop_reason=2, extra_ids=[2])
    assert outs[0].outputs[0].text.endswith("<|im_end|>")


def test_an_eos_other_than_the_tokenizers_is_reported_as_a_stop_token_as_vllm_does(tok):
    # generation_config may list more EOS ids than the tokenizer's own (SmolLM2: <|im_end|> = 2);
    # vLLM adds the others to the stop token ids, so its stop_reason names them
    assert tok.eos_token_id == 2 and tok.convert_ids_to_tokens(0) == "<|endoftext|>"
    outs, _, _ = drive(tok, "Bye now", SamplingParams(output_kind=FINAL), finish="stop", stop_reason=0,
                       extra_ids=[0])
    o = outs[0].outputs[0]
    assert (o.finish_reason, o.stop_reason, o.eos_token_id, o.text) == ("stop", 0, 0, "Bye now")


@pytest.mark.parametrize("kind", [DELTA, CUMULATIVE, FINAL])
def test_output_kinds(tok, kind):
    text = "Emoji 🎉 and 中文 in one"
    outs, _, ids = drive(tok, text, SamplingParams(output_kind=kind))
    assert outs[-1].finished and all(not o.finished for o in outs[:-1])
    if kind == FINAL:
        assert len(outs) == 1
    if kind == DELTA:
        assert len(outs) == len(ids)  # token ids are never held back: one output per token
        assert "".join(texts(outs)) == text
        assert sum((o.outputs[0].token_ids for o in outs), []) == ids
        assert [o.outputs[0].num_output_tokens for o in outs] == list(range(1, len(ids) + 1))
    else:
        assert outs[-1].outputs[0].text == text and outs[-1].outputs[0].token_ids == ids


def test_n_children_and_logprobs(tok):
    op = OutputProcessor(tok)
    params = SamplingParams(n=3, logprobs=1, seed=5, output_kind=FINAL)
    parent = ParentRequest("p", None, [1, 2], params, tok, 0.0)
    assert [c.req_id for c in parent.children] == ["0_p", "1_p", "2_p"]
    assert [c.params.seed for c in parent.children] == [5, 6, 7] and all(c.params.n == 1 for c in parent.children)
    op.add_request(parent)
    hello = tok.encode(" hello")[0]
    lp = SampleLogprobs(-0.25, 1, [hello, hello + 1], [-0.25, -2.0])
    for i in range(3):
        ros, _ = op.process_outputs([EngineCoreOutput(f"{i}_p", [hello], [lp],
                                                      finish_reason="length" if i < 2 else None)])
        assert ros == []  # FINAL_ONLY: nothing until every child finished
    ros, _ = op.process_outputs([EngineCoreOutput("2_p", [hello], [lp], finish_reason="length")])
    (ro,) = ros
    assert ro.finished and [o.index for o in ro.outputs] == [0, 1, 2]
    assert ro.outputs[2].text == " hello hello" and ro.outputs[0].text == " hello"
    entry = ro.outputs[2].logprobs[0]
    assert set(entry) == {hello} and entry[hello].decoded_token == " hello" and entry[hello].rank == 1
    assert ro.outputs[2].cumulative_logprob == pytest.approx(-0.5)


def test_abort_gives_final_output_next_step(tok):
    op = OutputProcessor(tok)
    op.add_request(ParentRequest("a", None, [1], SamplingParams(output_kind=DELTA), tok, 0.0))
    op.process_outputs([EngineCoreOutput("a", tok.encode(" partial"))])
    assert op.abort(["a", "unknown"]) == ["a"]
    ros, _ = op.process_outputs([])
    assert len(ros) == 1 and ros[0].finished and ros[0].outputs[0].finish_reason == "abort"
    assert not op.has_unfinished()


def test_min_tokens_gates_stop_strings(tok):
    # a stop string must end in the text of a token after the first min_tokens (vLLM's rule):
    # one ending within them, or at token min_tokens itself, stays in the text
    text = "a, b, c, d, e, f, g, h, i, j, k"
    params = SamplingParams(stop=[","], min_tokens=8, output_kind=CUMULATIVE)
    outs, stopped_at, ids = drive(tok, text, params)
    assert stopped_at is not None
    assert stopped_at + 1 > 8  # number of tokens generated when the stop string matched
    pieces = [tok.decode(ids[:k + 1]) for k in range(len(ids))]
    first_allowed = next(k for k in range(8, len(ids)) if pieces[k].count(",") > pieces[7].count(","))
    assert stopped_at == first_allowed
    final = outs[-1].outputs[0]
    assert final.finish_reason == "stop" and final.stop_reason == ","
    assert final.text == pieces[first_allowed][:pieces[first_allowed].rfind(",")]
    assert final.text.count(",") >= 2  # the commas before min_tokens stayed in the text


def test_stop_string_completed_by_token_min_tokens_does_not_stop(tok):
    text = "one two, three four, five"
    ids = tok.encode(text)
    comma = next(k for k in range(len(ids)) if "," in tok.decode(ids[:k + 1]))  # 0-based
    _, stopped_at, _ = drive(tok, text, SamplingParams(stop=[","], min_tokens=comma, output_kind=CUMULATIVE))
    assert stopped_at == comma  # the comma is token min_tokens + 1: it stops
    outs, stopped_at, _ = drive(tok, text, SamplingParams(stop=[","], min_tokens=comma + 1, output_kind=CUMULATIVE))
    assert stopped_at > comma  # the comma is token min_tokens: it does not
    assert outs[-1].outputs[0].text == "one two, three four"


@pytest.mark.parametrize("engine_interval,request_interval,expect", [(3, None, 3), (1, 4, 4), (4, 2, 4)])
def test_stream_interval_first_token_then_every_n_then_the_end(tok, engine_interval, request_interval, expect):
    # the request may raise the engine's interval, never lower it
    text = "Emoji 🎉 and 中文 in one sentence, then a few more words to stream"
    params = SamplingParams(output_kind=DELTA, stream_interval=request_interval)
    outs, _, ids = drive(tok, text, params, stream_interval=engine_interval)
    sizes = [len(o.outputs[0].token_ids) for o in outs]
    assert sizes[0] == 1  # the first token is never held
    assert all(n == expect for n in sizes[1:-1])
    assert 1 <= sizes[-1] <= expect and outs[-1].finished and not any(o.finished for o in outs[:-1])
    assert len(outs) == 1 + -(-(len(ids) - 1) // expect)
    assert sum((o.outputs[0].token_ids for o in outs), []) == ids
    assert "".join(texts(outs)) == text
    assert [o.outputs[0].num_output_tokens for o in outs] == list(itertools.accumulate(sizes))


def test_stream_interval_keeps_stop_strings_and_cumulative(tok):
    text = "alpha beta gamma STOP delta epsilon"
    outs, stopped_at, ids = drive(tok, text, SamplingParams(stop=[" STOP"], output_kind=DELTA), stream_interval=4)
    assert stopped_at is not None and outs[-1].finished and outs[-1].outputs[0].finish_reason == "stop"
    assert "".join(texts(outs)) == "alpha beta gamma"
    outs, _, ids = drive(tok, text, SamplingParams(output_kind=CUMULATIVE), stream_interval=4)
    assert [len(o.outputs[0].token_ids) for o in outs][:2] == [1, 5]  # everything so far, every 4 tokens
    assert outs[-1].outputs[0].text == text


def test_stream_interval_n_children_and_abort(tok):
    op = OutputProcessor(tok, 8)
    op.add_request(ParentRequest("p", None, [1], SamplingParams(n=2, output_kind=DELTA), tok, 0.0, 8))
    hello = tok.encode(" hello")[0]
    ros, _ = op.process_outputs([EngineCoreOutput("0_p", [hello]), EngineCoreOutput("1_p", [hello])])
    assert [o.index for o in ros[0].outputs] == [0, 1]  # first tokens at once
    for _ in range(3):
        ros, _ = op.process_outputs([EngineCoreOutput("0_p", [hello]), EngineCoreOutput("1_p", [hello])])
        assert ros == []
    ros, _ = op.process_outputs([EngineCoreOutput("1_p", [hello], finish_reason="length")])
    (ro,) = ros  # a child's end goes out at once, and every child's held tokens with it
    assert not ro.finished
    assert [(o.index, len(o.token_ids), o.finish_reason) for o in ro.outputs] == [(0, 3, None), (1, 4, "length")]
    assert op.abort(["p"]) == ["0_p"]
    (ro,), _ = op.process_outputs([])
    assert ro.finished and [(o.index, o.token_ids, o.finish_reason) for o in ro.outputs] == [(0, [], "abort")]
    with pytest.raises(ValueError, match="stream_interval"):
        OutputProcessor(tok, 0)
    with pytest.raises(ValueError, match="stream_interval"):
        SamplingParams(stream_interval=0)
