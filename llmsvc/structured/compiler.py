"""StructuredOutputsParams -> an llguidance matcher in its start state (torch-free).

llguidance (Rust, numpy bitmasks) was chosen over xgrammar, which imports torch and so could
not run in the engine; docs/structured-output.md has the measurements. Compiling = turning
the constraint into llguidance's grammar text, then building an `LLMatcher` (lexer and
parser tables for this tokenizer), which releases the GIL. Each request then deep-copies
the compiled matcher, which is cheap.
"""
from __future__ import annotations

import json
import re

import llguidance
import llguidance.hf

from llmsvc.sampling_params import StructuredOutputsParams
from llmsvc.structured import errors as E
from llmsvc.structured import structural_tag
from llmsvc.structured.vocabulary import Vocabulary

# JSON layout as Python's json.dumps writes it ("a": 1, "b": 2): no free whitespace, so the
# model cannot pad a document forever, with the spacing models are trained on
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


# the reason for a constraint of each kind that compiles to nothing usable
FAILURE_REASON = {"json": E.INVALID_SCHEMA, "json_object": E.INVALID_SCHEMA, "regex": E.INVALID_REGEX,
                  "choice": E.INVALID_CHOICE, "grammar": E.INVALID_GRAMMAR, "structural_tag": E.INVALID_GRAMMAR}


def build_tokenizer(hf_tokenizer, vocab_size: int, eos_token_ids: list[int]) -> llguidance.LLTokenizer:
    """The tokenizer view llguidance masks over. The mask is max(vocab_size, len(tokenizer))
    bits wide; ids the tokenizer lacks (padding rows of the model's vocabulary) are never
    allowed. Slow (about 0.5 s for a 49k vocabulary): build it once per engine."""
    n_vocab = max(vocab_size, len(hf_tokenizer))
    return llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=n_vocab,
                                        eos_token=list(eos_token_ids) or None)


def grammar_text(params: StructuredOutputsParams, tokenizer: llguidance.LLTokenizer | None = None) -> str:
    """llguidance grammar text for the constraint; raises ConstraintError for what it can tell
    without compiling (bad GBNF syntax, a malformed structural tag). Only structural tags read
    `tokenizer`: its special tokens, spelled in a tag's strings, are matched as those tokens
    (without it every string is plain text)."""
    kind = params.kind
    if kind == "structural_tag":
        return structural_tag.grammar(params.structural_tag, Vocabulary(tokenizer),
                                      _checked_leaf)
    if kind == "json":
        schema = params.json
        if isinstance(schema, str) and schema.strip() in ("true", "false"):
            schema = schema.strip() == "true"
        if schema is False:
            raise E.ConstraintError(kind, E.INVALID_SCHEMA, "is false: no JSON value matches it")
        if schema is True:  # the boolean schema true: any JSON value, as {}
            schema = {}
        schema = schema if isinstance(schema, str) else json.dumps(schema)
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_OPTIONS)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(params.regex)
    if kind == "choice":
        return llguidance.grammar_from("choice", params.choice)
    text = params.grammar
    if "::=" in text:  # GBNF
        text = _GBNF_ESCAPE.sub(_gbnf_code_point, text)
    try:  # Lark is used as is; anything else is read as GBNF and converted to Lark
        return llguidance.grammar_from("grammar", text)
    except ValueError as e:
        raise E.ConstraintError(kind, E.INVALID_GRAMMAR, f"is not a valid grammar: {e}") from None


# GBNF's \uXXXX and \UXXXXXXXX escapes (an escaped backslash is matched first and kept): the
# GBNF-to-Lark conversion drops their leading zeros ("\u00e9" -> "\ue9"), which Lark refuses
_GBNF_ESCAPE = re.compile(r"\\(?:u([0-9a-fA-F]{4})|U([0-9a-fA-F]{8})|.)", re.S)


def _gbnf_code_point(m: re.Match) -> str:
    """One escape as the conversion keeps it: `\\xNN` below 0x80 (it may be a quote, a bracket or
    a backslash), the character itself above (none of those needs escaping)."""
    digits = m.group(1) or m.group(2)
    if digits is None:
        return m.group(0)
    cp = int(digits, 16)
    if cp < 0x80:
        return f"\\x{cp:02x}"
    if 0xD800 <= cp <= 0xDFFF or cp > 0x10FFFF:
        return m.group(0)  # not a character: the grammar engine says so
    return chr(cp)


def _checked_leaf(kind: str, value) -> str:
    """Grammar text of a structural tag's json / regex / grammar part, checked as a constraint of
    that kind would be (ConstraintError of that kind otherwise)."""
    text = grammar_text(StructuredOutputsParams(**{kind: value}))
    err = llguidance.LLMatcher.validate_grammar(text)
    if err:
        raise _refusal(kind, err)
    return text


def compile_matcher(tokenizer: llguidance.LLTokenizer, params: StructuredOutputsParams) -> llguidance.LLMatcher:
    """A matcher in the start state, or ConstraintError saying why the constraint is unusable."""
    kind = params.kind
    matcher = llguidance.LLMatcher(tokenizer, grammar_text(params, tokenizer), log_level=0,
                                   limits=llguidance.LLParserLimits(verbose_errors=False))
    if matcher.is_error():
        raise _refusal(kind, matcher.get_error())
    # a constraint no text satisfies ([a&&b], {"$ref": "#"}) shows only once asked for the
    # first mask (it would allow only EOS): refuse it here, not as an empty "stop"
    mask = matcher.compute_bitmask()
    if matcher.is_error():
        raise E.ConstraintError(kind, FAILURE_REASON[kind], "is not satisfiable: no output matches it")
    # the lexer is built lazily: a pattern past its limits ("a{2000000}") fails on the first
    # token consumed, so consume one the mask allows, on a copy, and refuse it here
    probe = matcher.deep_copy()
    if probe.consume_token(_first_allowed(mask)):
        return matcher
    raise E.ConstraintError(kind, FAILURE_REASON[kind], "is too large for the grammar engine: "
                            + E.matcher_error(probe))


def _refusal(kind: str, err: str) -> E.ConstraintError:
    """The ConstraintError for the grammar engine's refusal `err` of a constraint of `kind`."""
    if kind in ("json", "json_object"):
        if "coerce_one_of" in err:  # llguidance's hint names an option of its own, not ours
            return E.ConstraintError(kind, E.UNSUPPORTED_SCHEMA_FEATURE, "uses oneOf with branches that can "
                                     "match the same value, which cannot be enforced exactly; use anyOf")
        if "Unimplemented" in err or "not supported" in err.lower():
            return E.ConstraintError(kind, E.UNSUPPORTED_SCHEMA_FEATURE, f"uses a JSON Schema feature that is "
                                     f"not supported: {err}")
        return E.ConstraintError(kind, E.INVALID_SCHEMA, f"is not a usable JSON Schema: {err}")
    if kind == "regex":
        return E.ConstraintError(kind, E.INVALID_REGEX, f"is not a valid regular expression: {err}")
    if kind == "choice":
        return E.ConstraintError(kind, E.INVALID_CHOICE, f"cannot be compiled: {err}")
    if kind == "structural_tag":
        return E.ConstraintError(kind, E.INVALID_GRAMMAR, f"cannot be compiled: {err}")
    return E.ConstraintError(kind, E.INVALID_GRAMMAR, f"is not a valid grammar: {err}")


def _first_allowed(bitmask: bytes) -> int:
    """The lowest token id set in a one-row bitmask (little-endian 32-bit words, bit t % 32 of
    word t // 32 for token t); a mask the satisfiability test passed has one."""
    value = int.from_bytes(bitmask, "little")
    return (value & -value).bit_length() - 1
