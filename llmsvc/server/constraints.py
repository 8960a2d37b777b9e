"""The SamplingParams.constraint oneof (proto) -> StructuredOutputsParams, and its errors.

Checked here, before the request is queued: the kind is served (UNIMPLEMENTED otherwise) and
what needs no compiling (JSON text, non-empty regex / grammar, a non-empty choice list).
Compiling happens in the engine's grammar pool; its failures come back as
llmsvc.structured.ConstraintError, which errors.py maps to INVALID_ARGUMENT with a field
violation on the proto field (constraint_fields.py) and ErrorInfo.reason saying which kind of
failure.
"""
from __future__ import annotations

import json

import grpc

from llmsvc import structured
from llmsvc.sampling_params import StructuredOutputsParams
from llmsvc.server.constraint_fields import PROTO_FIELDS
from llmsvc.server.errors import ServiceError, invalid
from llmsvc.structured import errors as E

MAX_CONSTRAINT_CHARS = 1 << 20  # a schema / grammar / regex, or all choices together


def served_constraints() -> tuple[str, ...]:
    """Proto names of the constraint kinds this build serves (GetModelInfo.supported_constraints)."""
    if not structured.available():
        return ()
    return tuple(PROTO_FIELDS[k] for k in structured.SUPPORTED_KINDS)


def structured_outputs_from_proto(sampling, supported: tuple[str, ...]) -> StructuredOutputsParams | None:
    """The request's constraint, checked as far as it can be without compiling."""
    which = sampling.WhichOneof("constraint")
    if which is None:
        return None
    name = f"sampling.{which}"
    if which not in supported:
        raise ServiceError(grpc.StatusCode.UNIMPLEMENTED,
                           f"{name}: structured output of this kind is not supported by this server "
                           f"(supported: {list(supported)})")
    if which == "choice":
        choices = list(sampling.choice.choices)
        if not choices:
            raise invalid("sampling.choice.choices", "must list at least one string", E.INVALID_CHOICE)
        for i, c in enumerate(choices):
            if not c:
                raise invalid(f"sampling.choice.choices[{i}]", "must not be empty", E.INVALID_CHOICE)
        check_size(name, sum(len(c) for c in choices))
        return StructuredOutputsParams(choice=choices)
    if which == "json_object":
        if not sampling.json_object:
            raise invalid(name, "must be true when set (leave the constraint unset for free text)",
                          E.INVALID_SCHEMA)
        return StructuredOutputsParams(json_object=True)
    text = getattr(sampling, which)
    check_size(name, len(text))
    if which == "json_schema":
        try:
            schema = json.loads(text)
        except json.JSONDecodeError as e:
            raise invalid(name, f"is not valid JSON: {e}", E.INVALID_JSON) from None
        except RecursionError:  # Python's parser gives up near 1000 levels
            raise invalid(name, "nests too deeply to be parsed", E.INVALID_JSON) from None
        if not isinstance(schema, (dict, bool)):
            raise invalid(name, f"must be a JSON Schema (an object or a boolean), got a JSON "
                          f"{type(schema).__name__}", E.INVALID_SCHEMA)
        return StructuredOutputsParams(json=text)
    if not text:
        reason = E.INVALID_REGEX if which == "regex" else E.INVALID_GRAMMAR
        raise invalid(name, "must not be empty", reason)
    return StructuredOutputsParams(**{which: text})


def check_size(name: str, n: int) -> None:
    """INVALID_ARGUMENT (CONSTRAINT_TOO_LARGE) on `name` for a constraint of over MAX_CONSTRAINT_CHARS."""
    if n > MAX_CONSTRAINT_CHARS:
        raise invalid(name, f"must be at most {MAX_CONSTRAINT_CHARS} characters, got {n}", "CONSTRAINT_TOO_LARGE")
