"""Structured output through the real engine and scheduler over the FakeExecutor (tests/engine_fakes.py),
which samples like a masked sampler (obey_grammar): WAITING_FOR_FSM, grammar-complete endings,
n > 1, preemption, abort, stop strings, compile errors and time limits, and the mask itself
against llguidance's own matcher."""
from __future__ import annotations

import json
import re
import time

import jsonschema
import llguidance
import numpy as np
import pytest

from llmsvc.engine.llm_engine import LLMEngine
from llmsvc.core.request import RequestStatus
from llmsvc.sampling_params import SamplingParams, StructuredOutputsParams as SO
from llmsvc.structured import ConstraintError
from llmsvc.structured.compiler import grammar_text
from llmsvc.structured.manager import StructuredOutputManager
from tests.engine_fakes import FakeExecutor, make_config
from tests.server_harness import EOS, TINY_VOCAB, letters, tiny_tokenizer

TOK = tiny_tokenizer()
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "n"], "additionalProperties": False}


def make_engine(num_blocks: int = 64, **kw) -> LLMEngine:
    config = make_config(num_blocks=num_blocks, block_size=4, max_num_seqs=8, max_num_batched_tokens=32, **kw)
    config.model_config.vocab_size = TINY_VOCAB
    config.model_config.eos_token_ids = [EOS]
    return LLMEngine(config, FakeExecutor(config, num_blocks=num_blocks, token_fn=letters), TOK)


@pytest.fixture
def engine():
    e = make_engine()
    yield e
    e.shutdown()


def run(engine, requests: dict[str, tuple[str, SamplingParams]]):
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, TOK.encode(prompt), params)
    done = {}
    for _ in range(2000):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if not engine.has_unfinished_requests():
            break
    assert not engine.has_unfinished_requests()
    assert engine.core.kv_cache_manager.num_free_blocks == engine.core.kv_cache_manager.num_blocks
    return done


def params(so, **kw):
    return SamplingParams(temperature=0.0, max_tokens=kw.pop("max_tokens", 60), structured_outputs=so, **kw)


def test_every_kind_ends_stop_and_matches(engine):
    done = run(engine, {
        "json": ("a", params(SO(json=SCHEMA))),
        "regex": ("b", params(SO(regex=r"[a-c]{2}-[0-9]{3}"))),
        "choice": ("c", params(SO(choice=["alpha", "beta", "gamma"]))),
        "grammar": ("d", params(SO(grammar='root ::= "x" [a-z] [a-z]? "."'))),
        "object": ("e", params(SO(json_object=True), max_tokens=200)),
        "free": ("f", SamplingParams(temperature=0.0, max_tokens=5)),
    })
    texts = {rid: out.outputs[0].text for rid, out in done.items()}
    jsonschema.validate(json.loads(texts["json"]), SCHEMA)
    assert re.fullmatch(r"[a-c]{2}-[0-9]{3}", texts["regex"])
    assert texts["choice"] in ("alpha", "beta", "gamma")
    assert re.fullmatch(r"x[a-z]{1,2}\.", texts["grammar"])
    assert isinstance(json.loads(texts["object"]), dict)
    for rid in ("json", "regex", "choice", "grammar", "object"):
        out = done[rid].outputs[0]
        assert out.finish_reason == "stop" and EOS not in out.token_ids, (rid, out)
    assert done["free"].outputs[0].finish_reason == "length"


def test_bystander_tokens_unchanged(engine):
    alone = run(engine, {"free": ("hello", SamplingParams(temperature=0.0, max_tokens=12))})
    mixed = run(engine, {"free2": ("hello", SamplingParams(temperature=0.0, max_tokens=12)),
                         "json": ("hello", params(SO(json=SCHEMA)))})
    assert mixed["free2"].outputs[0].token_ids == alone["free"].outputs[0].token_ids


def test_n_samples_each_get_their_own_grammar_state(engine):
    out = run(engine, {"r": ("abc", params(SO(regex=r"[a-z]{3}[0-9]"), n=3))})["r"]
    assert len(out.outputs) == 3
    for o in out.outputs:
        assert re.fullmatch(r"[a-z]{3}[0-9]", o.text) and o.finish_reason == "stop"


def test_max_tokens_cuts_with_length(engine):
    o = run(engine, {"r": ("a", params(SO(regex=r"[a-z]{50}"), max_tokens=7))})["r"].outputs[0]
    assert o.finish_reason == "length" and len(o.token_ids) == 7


def test_stop_string_inside_constrained_output(engine):
    o = run(engine, {"r": ("a", params(SO(regex=r"abbc[a-z]{6}"), stop=["bbc"]))})["r"].outputs[0]
    assert (o.text, o.finish_reason, o.stop_reason) == ("a", "stop", "bbc")


def test_preemption_recompute_keeps_grammar_state():
    reqs = {f"r{i}": (f"prompt {i} " * 3, params(SO(json=SCHEMA))) for i in range(6)}
    roomy = make_engine(num_blocks=256)
    tight = make_engine(num_blocks=24)  # 6 requests x ~10 blocks each: preemption is certain
    try:
        expected = run(roomy, reqs)
        got = run(tight, reqs)
        assert tight.core.scheduler.num_preemptions > 0
        for rid in reqs:
            assert got[rid].outputs[0].token_ids == expected[rid].outputs[0].token_ids
            jsonschema.validate(json.loads(got[rid].outputs[0].text), SCHEMA)
    finally:
        roomy.shutdown()
        tight.shutdown()


def test_request_waits_for_its_grammar_without_stalling_others(engine, monkeypatch):
    from concurrent.futures import Future

    pending: Future = Future()
    mgr = engine.structured_output_manager
    monkeypatch.setattr(mgr, "submit", lambda so: pending)
    engine.add_request("slow", TOK.encode("x"), params(SO(regex="[a-z]+")))
    engine.add_request("free", TOK.encode("y"), SamplingParams(temperature=0.0, max_tokens=3))
    for _ in range(10):
        engine.step()
    sched = engine.core.scheduler
    assert [r.request_id for r in sched.waiting_for_fsm] == ["slow"]
    assert sched.requests["slow"].status == RequestStatus.WAITING_FOR_FSM
    assert "free" not in sched.requests  # finished meanwhile
    monkeypatch.undo()
    pending.set_result(mgr.submit(SO(regex="[a-z]{2}")).result())  # the grammar arrives
    outs = [o for _ in range(20) for o in engine.step() if o.finished]
    assert [o.request_id for o in outs] == ["slow"] and re.fullmatch("[a-z]{2}", outs[0].outputs[0].text)


def test_abort_while_waiting_for_grammar_frees_everything(engine, monkeypatch):
    from concurrent.futures import Future

    monkeypatch.setattr(engine.structured_output_manager, "submit", lambda so: Future())
    engine.add_request("w", TOK.encode("x"), params(SO(regex="[a-z]+")))
    engine.step()
    engine.abort_request("w")
    outs = [o for o in engine.step() if o.finished]
    assert outs and outs[0].outputs[0].finish_reason == "abort"
    assert not engine.has_unfinished_requests() and not engine.core.scheduler.waiting_for_fsm


def test_compile_failure_is_cached_and_raised_at_admission(engine):
    bad = SO(regex="a(b")
    with pytest.raises(ConstraintError) as ei:
        engine.structured_output_manager.wait(bad)
    assert ei.value.reason == "INVALID_REGEX" and ei.value.field == "structured_outputs.regex"
    with pytest.raises(ConstraintError):  # the cached failure: refused before queueing
        engine.add_request("bad", TOK.encode("x"), params(bad))
    assert not engine.has_unfinished_requests()


def test_compile_time_limit(engine):
    mgr = engine.structured_output_manager
    mgr.compile_timeout_s = 1e-9
    with pytest.raises(ConstraintError) as ei:
        mgr.wait(SO(regex="[0-9]+z"), timeout_s=30)
    assert ei.value.reason == "COMPILE_TIMEOUT"


def test_the_time_limit_starts_once_the_tokenizer_view_is_built():
    # the first constraint waits for the one-time tokenizer view (0.5-2 s); that wait must not
    # use up its compile time limit, in the core (here) or in the front end
    from concurrent.futures import Future

    from llmsvc.structured.request import StructuredRequest
    tokenizer, compiled = Future(), Future()
    st = StructuredRequest("regex", compiled, 1.0, tokenizer)
    t0 = time.monotonic()
    assert st.poll(t0 + 5.0) is False  # long past the limit, but the view is still building
    tokenizer.set_result(object())
    assert st.poll(t0 + 5.5) is False  # within 1 s of the view being ready
    with pytest.raises(ConstraintError, match="did not compile within 1 s"):
        st.poll(t0 + 6.1)


def test_a_schema_dicts_property_order_is_its_own_grammar():
    # the grammar writes properties in the schema's order: {"a", "b"} and {"b", "a"} differ
    ab = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}
    ba = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "integer"}}}
    assert SO(json=ab).key() != SO(json=ba).key()
    assert SO(json=ab).key() == SO(json=json.loads(json.dumps(ab))).key()


@pytest.mark.parametrize("escaped, plain", [
    ('root ::= "\\u00e9"', 'root ::= "é"'), ('root ::= [\\u00e0-\\u00ff]', 'root ::= [à-ÿ]'),
    ('root ::= "\\U0001F600"', 'root ::= "😀"'), ('root ::= "\\u0041"', 'root ::= "\\x41"'),
    ('root ::= "\\u0022"', 'root ::= "\\x22"'),  # a quote stays escaped
    ('root ::= "\\\\u00e9"', 'root ::= "\\\\u00e9"'),  # an escaped backslash, then "u00e9"
])
def test_gbnf_unicode_escapes_mean_their_characters(engine, escaped, plain):
    assert grammar_text(SO(grammar=escaped)) == grammar_text(SO(grammar=plain))
    engine.structured_output_manager.wait(SO(grammar=escaped))  # compiles (the zeros used to be lost)


def test_grammar_cache_is_bounded_and_keyed_by_spec(engine):
    mgr = engine.structured_output_manager
    mgr.cache_size = 2
    a = mgr.submit(SO(json={"type": "integer"}))
    assert mgr.submit(SO(json='{"type": "integer"}')) is a or mgr.submit(SO(json={"type": "integer"})) is a
    mgr.submit(SO(regex="x"))
    mgr.submit(SO(regex="y"))
    assert mgr.submit(SO(json={"type": "integer"})) is not a  # evicted, compiled again


@pytest.mark.parametrize("so,tokens", [
    (SO(json=SCHEMA), '{"name": "ab", "n": 42}'),
    (SO(regex=r"(yes|no)[0-9]*"), "no123"),
    (SO(grammar='start: "a" ("b" | "c")* "d"'), "abcbd"),
])
def test_mask_equals_llguidance_matcher_step_by_step(so, tokens):
    """Our per-step bitmask (manager + request state, as the engine drives them) against an
    independent llguidance matcher: bit t is set iff that matcher accepts token t."""
    vocab = TINY_VOCAB + 13  # the model's vocabulary padded past the tokenizer's
    mgr = StructuredOutputManager(TOK, vocab, [EOS])
    try:
        req = mgr.new_request(so)
        mgr.wait(so)
        assert req.poll()
        ref = llguidance.LLMatcher(llguidance.hf.from_tokenizer(TOK, n_vocab=vocab, eos_token=EOS),
                                   grammar_text(so), log_level=0)
        ids = TOK.encode(tokens) + [EOS]
        for step, tok in enumerate(ids):
            mask = mgr.fill_bitmask([req])[0]
            assert mask.shape == ((vocab + 31) // 32,)
            bits = np.unpackbits(mask.view(np.uint8), bitorder="little")[:vocab].astype(bool)
            accepts = np.zeros(vocab, dtype=bool)
            for t in range(vocab):
                m = ref.deep_copy()
                accepts[t] = m.consume_token(t) and not m.is_error()
            assert np.array_equal(bits, accepts), (step, np.flatnonzero(bits != accepts)[:10])
            assert not bits[TINY_VOCAB:].any()  # padding ids are never allowed
            assert bits[EOS] == ref.is_accepting()  # EOS only where the grammar may end
            assert req.accept(tok) and ref.consume_token(tok)
        assert req.terminated
    finally:
        mgr.shutdown()


def test_chunked_prefill_masks_only_the_rows_that_sample(engine):
    """A 100-token prompt over a 32-token budget takes several steps; the bitmask covers a
    constrained request only in the steps where it samples, and every other row is left alone."""
    ex = engine.core.executor
    inner, seen = ex.execute_model, []

    def spy(so):
        out = inner(so)
        seen.append((list(so.structured_output_req_ids), list(out.req_ids)))
        return out
    ex.execute_model = spy
    done = run(engine, {"long": ("p" * 100, params(SO(regex=r"[a-z]{4}!"))),
                        "free": ("q" * 40, SamplingParams(temperature=0.0, max_tokens=6))})
    assert re.fullmatch(r"[a-z]{4}!", done["long"].outputs[0].text)
    masked_steps = [ids for ids, _ in seen if ids]
    assert len(masked_steps) == 5 and all(ids == ["long"] for ids in masked_steps)
    assert all(set(ids) <= set(sampled) for ids, sampled in seen)
    assert sum(1 for _, sampled in seen if "long" not in sampled) >= 3  # prefill chunks: no mask
