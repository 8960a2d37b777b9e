"""Which proto field each structured-output kind arrives in: the SamplingParams.constraint oneof.

Data only, so that both the request mapping (constraints.py, which raises ServiceErrors) and the
error mapping (errors.py, which reports a grammar that did not compile on its proto field) read
it without importing each other.
"""
from __future__ import annotations

# StructuredOutputsParams field -> SamplingParams.constraint oneof field (proto)
PROTO_FIELDS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
                "json_object": "json_object"}
