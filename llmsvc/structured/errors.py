"""ConstraintError: a structured-output constraint that cannot be served (torch-free)."""
from __future__ import annotations

# ConstraintError.reason values (the server sends them as ErrorInfo.reason)
INVALID_JSON = "INVALID_JSON"
INVALID_SCHEMA = "INVALID_SCHEMA"
UNSUPPORTED_SCHEMA_FEATURE = "UNSUPPORTED_SCHEMA_FEATURE"
INVALID_REGEX = "INVALID_REGEX"
INVALID_CHOICE = "INVALID_CHOICE"
INVALID_GRAMMAR = "INVALID_GRAMMAR"
COMPILE_TIMEOUT = "COMPILE_TIMEOUT"
COMPILE_CANCELLED = "COMPILE_CANCELLED"

_MAX_MESSAGE_CHARS = 600


def matcher_error(matcher) -> str:
    """An llguidance matcher's error message, without the marker its non-verbose mode appends."""
    return matcher.get_error().replace("<non-verbose/>", "").strip()


class ConstraintError(ValueError):
    """`kind` is the StructuredOutputsParams field (json, regex, choice, grammar, json_object);
    `field` is "structured_outputs.<kind>"; `reason` one of the constants above."""

    def __init__(self, kind: str, reason: str, message: str) -> None:
        message = " ".join(message.split())  # grammar-engine errors span lines (carets, excerpts)
        if len(message) > _MAX_MESSAGE_CHARS:
            message = message[:_MAX_MESSAGE_CHARS - 3] + "..."
        self.kind, self.reason, self.message = kind, reason, message
        self.field = f"structured_outputs.{kind}"
        super().__init__(f"{self.field} {message}")
