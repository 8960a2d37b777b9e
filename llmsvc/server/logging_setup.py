"""Server logging: `--log-format text|json`, with the request id of the RPC being served.

The request id lives in a ContextVar (`request_id_var`); each grpc.aio RPC runs in its own task,
so setting it at the top of a handler tags every log line that handler (and what it awaits)
emits, and no other. The request's GenerateRequest.labels ride along the same way
(`request_labels_var`). json: one object per line with ts, level, logger, msg, request_id and
labels (when known), exc (when there is a traceback) and any `extra=` fields that are
JSON-serialisable. text: " [req=ID labels={...}]" after the logger name; label values are JSON
strings there, so a label can never break a line.
"""
from __future__ import annotations

import contextvars
import json
import logging
import sys
import time

request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("llmsvc_request_id", default=None)
request_labels_var: contextvars.ContextVar[dict | None] = contextvars.ContextVar("llmsvc_request_labels",
                                                                                  default=None)
LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s%(request_tag)s: %(message)s"

# attributes every LogRecord has; anything else came from `extra=` and is carried into json
_STANDARD = set(vars(logging.LogRecord("x", 0, "x", 0, "x", None, None))) | {"message", "asctime", "request_tag",
                                                                            "request_id", "labels"}


class RequestIdFilter(logging.Filter):
    """Sets record.request_id and record.labels (from `extra=` or the ContextVars) and
    record.request_tag (" [req=ID labels={...}]", or less when unknown)."""

    def filter(self, record: logging.LogRecord) -> bool:
        rid = getattr(record, "request_id", None) or request_id_var.get()
        labels = getattr(record, "labels", None) or request_labels_var.get()
        record.request_id, record.labels = rid, labels
        tag = ([f"req={rid}"] if rid else []) + ([f"labels={json.dumps(labels, sort_keys=True)}"] if labels else [])
        record.request_tag = f" [{' '.join(tag)}]" if tag else ""
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: {"ts", "level", "logger", "msg", "request_id"?, "exc"?, **extra}."""

    def format(self, record: logging.LogRecord) -> str:
        t = record.created
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1000):03d}Z"
        obj = {"ts": ts, "level": record.levelname, "logger": record.name, "msg": record.getMessage()}
        rid = getattr(record, "request_id", None) or request_id_var.get()
        if rid:
            obj["request_id"] = rid
        labels = getattr(record, "labels", None) or request_labels_var.get()
        if labels:
            obj["labels"] = labels
        if record.exc_info:
            obj["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            obj["exc"] = record.exc_text
        for k, v in vars(record).items():
            if k not in _STANDARD and k not in obj:
                try:
                    json.dumps(v)
                except (TypeError, ValueError):
                    v = repr(v)
                obj[k] = v
        return json.dumps(obj, ensure_ascii=False)


def make_handler(fmt: str = "text", stream=None) -> logging.Handler:
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {LOG_FORMATS}, got {fmt!r}")
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    return handler


def setup_logging(level: str | int = "INFO", fmt: str = "text", stream=None) -> logging.Handler:
    """Replace the root logger's handlers with one `fmt` handler at `level`; returns the handler."""
    if isinstance(level, str):
        level = logging.getLevelName(level.upper())
        if not isinstance(level, int):
            level = logging.INFO
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    handler = make_handler(fmt, stream)
    root.addHandler(handler)
    root.setLevel(level)
    logging.captureWarnings(True)
    return handler
