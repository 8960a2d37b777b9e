"""What each SamplingParams field is beyond its Python type: declared once, on the field.

A field of `llmsvc.sampling_params.SamplingParams` that a client can set carries a `Facts` in
its dataclass metadata (`sampling_field(...)`): where it lives in llmsvc.v1's GenerateRequest,
the range `SamplingParams.verify()` enforces, whether generation_config.json may give its
default, and its `llmsvc generate` flag. Everything else is derived from these declarations:

- verify()'s range checks and messages, and the int / float normalization of the fields;
- the llmsvc.v1 door's mapping of optional scalars and the proto path of an error's field;
- the generation_config keys read from a checkpoint, and `GetModelInfo.default_sampling`;
- the `llmsvc generate` sampling flags.

Pure Python with no dependencies: the client (which has no torch and no server extra) reads it.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Iterator

# `llmsvc generate` flag kinds: a number type (the proto field's), a string, a repeated flag
# (action="append" of that kind) or a switch (store_true); the client maps each to a parser
CLI_KINDS = ("float", "int32", "uint32", "uint64", "str", "bool")


@dataclass(frozen=True)
class Facts:
    proto: str  # llmsvc.v1 GenerateRequest path, "sampling.temperature"
    kind: str = ""  # "float" or "int": the field's number type (normalized, range-checked); "": not a number
    lo: float | None = None  # inclusive lower bound unless lo_open
    hi: float | None = None  # inclusive upper bound unless hi_open
    lo_open: bool = False
    hi_open: bool = False
    range_text: str = ""  # how a message states the range, when the bounds alone do not say it
    generation_config: bool = False  # an unset field takes generation_config.json's value of this name
    cli: str = ""  # flag kind (CLI_KINDS); "": no `llmsvc generate` flag
    flag: str = ""  # the flag's spelling, when not --name-with-dashes
    repeated: bool = False  # the flag may be given more than once (a list field)
    help: str = ""

    @property
    def proto_parent(self) -> str:
        """The GenerateRequest message that holds the field ("" for a top-level field)."""
        return self.proto.rpartition(".")[0]

    @property
    def proto_name(self) -> str:
        return self.proto.rpartition(".")[2]

    def violation(self, value) -> str | None:
        """Why `value` is out of this field's range ("must be in (0, 1], got 0.0"); None when in
        range or unbounded. None values (unset optional fields) are in range."""
        if value is None or not self.kind:
            return None
        if self.kind == "float" and not math.isfinite(value):
            return f"must be a finite number, got {value}"
        low_bad = self.lo is not None and (value <= self.lo if self.lo_open else value < self.lo)
        high_bad = self.hi is not None and (value >= self.hi if self.hi_open else value > self.hi)
        if low_bad or high_bad:
            return f"must be {self.range_text or self.describe_range()}, got {value}"
        return None

    def describe_range(self) -> str:
        lo, hi = self.lo, self.hi
        if lo is not None and hi is not None:
            return f"in {'(' if self.lo_open else '['}{lo:g}, {hi:g}{')' if self.hi_open else ']'}"
        if lo is not None:
            return f"{'>' if self.lo_open else '>='} {lo:g}"
        if hi is not None:
            return f"{'<' if self.hi_open else '<='} {hi:g}"
        return "any value"


def sampling_field(default: Any = dataclasses.MISSING, *, default_factory: Any = dataclasses.MISSING,
                   **facts: Any) -> Any:
    """A dataclass field that declares its Facts (see the module docstring)."""
    if facts.get("cli") and facts["cli"] not in CLI_KINDS:
        raise ValueError(f"cli must be one of {CLI_KINDS}, got {facts['cli']!r}")
    return dataclasses.field(default=default, default_factory=default_factory, metadata={"facts": Facts(**facts)})


def declared(cls) -> Iterator[tuple[dataclasses.Field, Facts]]:
    """(field, facts) for every field of dataclass `cls` that declares Facts, in field order."""
    for f in dataclasses.fields(cls):
        facts = f.metadata.get("facts")
        if facts is not None:
            yield f, facts


def field_default(f: dataclasses.Field):
    """A field's default value (a fresh one for a default_factory)."""
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
