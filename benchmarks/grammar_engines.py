"""Grammar engines for structured output, side by side: compile time, per-token mask time and
JSON Schema coverage, on the default model's tokenizer (docs/structured-output.md has a run).

    python -m benchmarks.grammar_engines               # llguidance (a dependency)
    python -m benchmarks.grammar_engines xgrammar      # needs `pip install xgrammar` (pulls torch)

Compile: llguidance LLMatcher(tokenizer, grammar) vs xgrammar GrammarCompiler.compile_json_schema.
Mask: filling one request's bitmask before every token of a valid document, then consuming it.
"""
from __future__ import annotations

import json
import statistics
import sys
import time

SCHEMAS = {
    "tool_call": {"type": "object", "properties": {
        "name": {"type": "string", "enum": ["get_weather", "get_time"]},
        "arguments": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                       "unit": {"enum": ["C", "F"]}},
                      "required": ["city", "unit"], "additionalProperties": False}},
        "required": ["name", "arguments"], "additionalProperties": False},
    "person": {"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "emails": {"type": "array", "items": {"type": "string", "format": "email"}, "maxItems": 3}},
        "required": ["name", "age"]},
    "ref_recursion": {"$defs": {"node": {"type": "object", "properties": {
        "v": {"type": "integer"}, "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]}},
        "required": ["v", "next"]}}, "$ref": "#/$defs/node"},
    "pattern_format": {"type": "object", "properties": {
        "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}, "when": {"type": "string", "format": "date-time"}},
        "required": ["id", "when"]},
    "allof_oneof": {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}},
                              {"properties": {"b": {"oneOf": [{"type": "string"}, {"type": "number"}]}}}],
                    "required": ["a", "b"]},
    "uniqueItems": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 4, "uniqueItems": True},
    "not": {"not": {"type": "string"}},
    "if_then": {"type": "object", "if": {"properties": {"a": {"const": 1}}}, "then": {"required": ["b"]}},
    "multipleOf": {"type": "number", "multipleOf": 0.5},
    "dependentRequired": {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "string"}},
                          "dependentRequired": {"a": ["b"]}},
}
DOCUMENTS = {"tool_call": '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}',
             "person": '{"name": "Ann Lee", "age": 42, "emails": ["ann@example.com", "a.lee@mail.org"]}'}


def _report(name: str, dt: float, error: str | None) -> None:
    print(f"{name:18s} compile {dt * 1e3:8.2f} ms  {'ERROR ' + error[:90] if error else 'ok'}")


def _mask_line(times: list[float]) -> None:
    print(f"{'':18s} mask per token: median {statistics.median(times) * 1e6:.0f} us, mean "
          f"{statistics.mean(times) * 1e6:.0f} us, max {max(times) * 1e6:.0f} us over {len(times)} steps")


def run_llguidance(tok, vocab: int) -> None:
    import llguidance
    import llguidance.hf
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

    t0 = time.perf_counter()
    lt = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
    print(f"llguidance {llguidance.__version__}: tokenizer set-up {(time.perf_counter() - t0) * 1e3:.0f} ms")
    for name, schema in SCHEMAS.items():
        t0 = time.perf_counter()
        m = llguidance.LLMatcher(lt, llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema)), log_level=0)
        _report(name, time.perf_counter() - t0, m.get_error() if m.is_error() else None)
        if name in DOCUMENTS and not m.is_error():
            bitmask, times = allocate_token_bitmask(1, vocab), []
            for tid in tok.encode(DOCUMENTS[name]):
                t0 = time.perf_counter()
                fill_next_token_bitmask(m, bitmask, 0)
                times.append(time.perf_counter() - t0)
                assert m.consume_token(tid), m.get_error()
            _mask_line(times)


def run_xgrammar(tok, vocab: int) -> None:
    import xgrammar as xgr

    t0 = time.perf_counter()
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab), max_threads=1)
    print(f"xgrammar: tokenizer set-up {(time.perf_counter() - t0) * 1e3:.0f} ms")
    for name, schema in SCHEMAS.items():
        t0 = time.perf_counter()
        try:
            compiled, error = compiler.compile_json_schema(json.dumps(schema)), None
        except Exception as e:  # noqa: BLE001 - report whatever the library refuses
            compiled, error = None, str(e)
        _report(name, time.perf_counter() - t0, error)
        if name in DOCUMENTS and compiled is not None:
            m, bitmask, times = xgr.GrammarMatcher(compiled), xgr.allocate_token_bitmask(1, vocab), []
            for tid in tok.encode(DOCUMENTS[name]):
                t0 = time.perf_counter()
                m.fill_next_token_bitmask(bitmask, 0)
                times.append(time.perf_counter() - t0)
                assert m.accept_token(tid)
            _mask_line(times)


def main(argv: list[str]) -> int:
    from transformers import AutoTokenizer

    from llmsvc.config import ModelConfig
    from llmsvc.models.resolve import resolve_model_config

    mc = resolve_model_config(ModelConfig())
    tok = AutoTokenizer.from_pretrained(mc.model_dir)
    (run_xgrammar if argv[:1] == ["xgrammar"] else run_llguidance)(tok, mc.vocab_size)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
