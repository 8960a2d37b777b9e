"""StructuredOutputsParams: a request's structured-output constraint, named as vLLM names them.

Torch-free and dependency-free; `llmsvc.sampling_params` re-exports it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from llmsvc.sampling_params_error import SamplingParamsError


@dataclass
class StructuredOutputsParams:
    """Structured output: exactly one constraint, named as vLLM names them.

    json: a JSON Schema (dict, or its JSON text); regex: the whole output must match;
    choice: the output is exactly one of these strings; grammar: Lark or GBNF (EBNF) text;
    json_object: any JSON object; structural_tag: xgrammar's structural tag as JSON text (free
    text with tagged, constrained regions; docs/structured-output.md). `verify()` checks only
    what needs no compiling (the grammar engine reports the rest when the constraint is compiled).
    """

    json: str | dict | bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None

    KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")

    def __post_init__(self) -> None:
        if isinstance(self.choice, tuple):
            self.choice = list(self.choice)
        self.verify()

    @property
    def kind(self) -> str:
        return next(k for k in self.KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple[str, str]:
        """(kind, canonical text): the cache key of the compiled grammar."""
        kind, value = self.kind, getattr(self, self.kind)
        if kind == "json":
            # property order is kept: the grammar writes properties in the schema's order
            text = value if isinstance(value, str) else json.dumps(value)
        elif kind == "choice":
            text = json.dumps(value)
        elif kind == "json_object":
            text = ""
        else:
            text = value
        return kind, text

    def verify(self) -> None:
        set_ = [k for k in self.KINDS if getattr(self, k) not in (None, False)]
        if len(set_) != 1:
            raise SamplingParamsError("structured_outputs", f"must set exactly one of {', '.join(self.KINDS)}; "
                                      f"got {', '.join(set_) or 'none'}")
        kind = set_[0]
        value: Any = getattr(self, kind)
        if kind == "json":
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except json.JSONDecodeError as e:
                    raise SamplingParamsError("structured_outputs.json", f"is not valid JSON: {e}") from None
            if not isinstance(value, (dict, bool)):
                raise SamplingParamsError("structured_outputs.json", "must be a JSON Schema: an object or a "
                                          f"boolean, got {type(value).__name__}")
        elif kind == "choice":
            if not self.choice:
                raise SamplingParamsError("structured_outputs.choice", "must list at least one string")
            if not all(isinstance(c, str) and c for c in self.choice):
                raise SamplingParamsError("structured_outputs.choice", "entries must be non-empty strings")
        elif kind in ("regex", "grammar") and not isinstance(value, str):
            raise SamplingParamsError(f"structured_outputs.{kind}", "must be a string")
        elif kind == "json_object" and value is not True:
            raise SamplingParamsError("structured_outputs.json_object", "must be True when set")
        elif kind == "structural_tag":
            _verify_structural_tag(value)


def _verify_structural_tag(value: Any) -> None:
    """JSON text of an object in one of xgrammar's two shapes, as vLLM takes them: legacy
    {"structures": [...], "triggers": [...]}, or {"format": {...}}; "type", where given, is
    "structural_tag". The formats inside are checked when it compiles."""
    field = "structured_outputs.structural_tag"
    if not isinstance(value, str):
        raise SamplingParamsError(field, f"must be JSON text, got {type(value).__name__}")
    try:
        tag = json.loads(value)
    except (json.JSONDecodeError, RecursionError) as e:
        raise SamplingParamsError(field, f"is not valid JSON: {e}") from None
    if not isinstance(tag, dict):
        raise SamplingParamsError(field, f"must be a JSON object, got a JSON {type(tag).__name__}")
    if tag.get("type", "structural_tag") != "structural_tag":
        raise SamplingParamsError(field, f'has "type" {tag["type"]!r}; it must be "structural_tag"')
    if "structures" in tag:
        if not isinstance(tag["structures"], list) or not isinstance(tag.get("triggers"), list):
            raise SamplingParamsError(field, 'in the legacy form must have "structures" and "triggers" lists')
    elif not isinstance(tag.get("format"), dict):
        raise SamplingParamsError(field, 'must have a "format" object (or legacy "structures" and "triggers")')
