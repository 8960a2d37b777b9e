"""StructuredOutputsParams -> an llguidance matcher in its start state (torch-free).

llguidance (Rust, numpy bitmasks) was chosen over xgrammar, which imports torch and so could
not run in the engine; docs/structured-output.md has the measurements. Compiling = turning
the constraint into llguidance's grammar text, then building an `LLMatcher` (lexer and
parser tables for this tokenizer), which releases the GIL. Each request then deep-copies
the compiled matcher, which is cheap.
"""
from __future__ import annotations

import json

import llguidance
import llguidance.hf

from llmsvc.sampling_params import StructuredOutputsParams
from llmsvc.structured import errors as E

# JSON layout as Python's json.dumps writes it ("a": 1, "b": 2): no free whitespace, so the
# model cannot pad a document forever, with the spacing models are trained on
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def build_tokenizer(hf_tokenizer, vocab_size: int, eos_token_ids: list[int]) -> llguidance.LLTokenizer:
    """The tokenizer view llguidance masks over. The mask is max(vocab_size, len(tokenizer))
    bits wide; ids the tokenizer lacks (padding rows of the model's vocabulary) are never
    allowed. Slow (about 0.5 s for a 49k vocabulary): build it once per engine."""
    n_vocab = max(vocab_size, len(hf_tokenizer))
    return llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=n_vocab,
                                        eos_token=list(eos_token_ids) or None)


def grammar_text(params: StructuredOutputsParams) -> str:
    """llguidance grammar text for the constraint; raises ConstraintError for what it can tell
    without a tokenizer (bad GBNF syntax)."""
    kind = params.kind
    if kind == "json":
        schema = params.json if isinstance(params.json, str) else json.dumps(params.json)
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_OPTIONS)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(params.regex)
    if kind == "choice":
        return llguidance.grammar_from("choice", params.choice)
    try:  # Lark is used as is; anything else is read as GBNF and converted to Lark
        return llguidance.grammar_from("grammar", params.grammar)
    except ValueError as e:
        raise E.ConstraintError(kind, E.INVALID_GRAMMAR, f"is not a valid grammar: {e}") from None


def compile_matcher(tokenizer: llguidance.LLTokenizer, params: StructuredOutputsParams) -> llguidance.LLMatcher:
    """A matcher in the start state, or ConstraintError saying why the constraint is unusable."""
    kind = params.kind
    matcher = llguidance.LLMatcher(tokenizer, grammar_text(params), log_level=0,
                                   limits=llguidance.LLParserLimits(verbose_errors=False))
    if not matcher.is_error():
        return matcher
    err = matcher.get_error()
    if kind in ("json", "json_object"):
        if "Unimplemented" in err or "not supported" in err.lower():
            raise E.ConstraintError(kind, E.UNSUPPORTED_SCHEMA_FEATURE, f"uses a JSON Schema feature that is "
                                    f"not supported: {err}")
        raise E.ConstraintError(kind, E.INVALID_SCHEMA, f"is not a usable JSON Schema: {err}")
    if kind == "regex":
        raise E.ConstraintError(kind, E.INVALID_REGEX, f"is not a valid regular expression: {err}")
    if kind == "choice":
        raise E.ConstraintError(kind, E.INVALID_CHOICE, f"cannot be compiled: {err}")
    raise E.ConstraintError(kind, E.INVALID_GRAMMAR, f"is not a valid grammar: {err}")
