"""SamplingParamsError: a sampling field out of range, with the field named as data."""
from __future__ import annotations


class SamplingParamsError(ValueError):
    """A field out of range: `field` names it ("stop[1]", "logit_bias[7]"), `why` says what is allowed."""

    def __init__(self, field: str, why: str) -> None:
        super().__init__(f"{field} {why}")
        self.field = field
        self.why = why
