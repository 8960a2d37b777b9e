"""Argument types of `llmsvc serve`'s flags (argparse `type=` callables: a bad value is a usage
error naming the flag) and the LLMSVC_<FLAG> environment twins' defaults."""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

from llmsvc.client.cli_common import int_in, positive_float  # noqa: F401 - positive_float: for cli.py
from llmsvc.config import parse_memory


def parse_bytes(text: str) -> int:
    """llmsvc.config.parse_memory for argparse: '2G' and '2GiB' -> 2147483648; '512MB' -> 512000000."""
    try:
        return parse_memory(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


positive_int = int_in(1)
non_negative_int = int_in(0)


def port(text: str) -> int:
    v = int(text)
    if not 0 <= v <= 65535:  # the OS would take a value past it modulo 65536
        raise argparse.ArgumentTypeError(f"must be a port in [0, 65535], got {v}")
    return v


def fraction(text: str) -> float:
    v = float(text)
    if not 0 < v <= 1:  # NaN too
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return v


def json_object(text: str) -> dict:
    try:
        v = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(v, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text}")
    return v


def non_negative_float(text: str) -> float:
    v = float(text)
    if not 0 <= v < math.inf:  # NaN too
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return v


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def log_level(text: str) -> str:
    v = text.strip().upper()
    if v not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(LOG_LEVELS)}, got {text!r}")
    return v


def lora_module(text: str) -> tuple[str, str]:
    """NAME=PATH, or vLLM's JSON form {"name": NAME, "path": PATH}."""
    if text.lstrip().startswith("{"):
        v = json_object(text)
        name, path = v.get("name"), v.get("path")
    else:
        name, _, path = text.partition("=")
    if not name or not path:
        raise argparse.ArgumentTypeError(f"a LoRA module is NAME=PATH, got {text!r}")
    return name.strip(), path.strip()


def lora_modules_env() -> list[tuple[str, str]] | None:
    """LLMSVC_LORA_MODULES: NAME=PATH items separated by whitespace or commas."""
    v = os.environ.get("LLMSVC_LORA_MODULES")
    if not v:
        return None
    try:
        return [lora_module(item) for item in v.replace(",", " ").split()]
    except argparse.ArgumentTypeError as e:
        raise SystemExit(f"LLMSVC_LORA_MODULES: {e}") from None


def env_name(name: str) -> str:
    """The environment twin of flag `name` (dashes or underscores): LLMSVC_<NAME>."""
    return "LLMSVC_" + name.upper().replace("-", "_")


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


def env_default(name: str, default, type_=str, choices=None):
    """A flag's default: its LLMSVC_ twin's value when set (converted by type_ and checked
    against choices, as the flag's own value would be), else `default`. A bad value is a usage
    error naming the variable (exit 2)."""
    env = env_name(name)
    v = os.environ.get(env)
    if v is None:
        return default
    try:
        if type_ is bool:
            if v.strip().lower() not in _TRUE + _FALSE:
                raise ValueError(f"must be one of {', '.join(_TRUE + _FALSE[:-1])}")
            return v.strip().lower() in _TRUE
        value = type_(v)
        if choices is not None and value not in choices:
            raise ValueError(f"must be one of {', '.join(map(str, choices))}")
        return value
    except (ValueError, TypeError, argparse.ArgumentTypeError) as e:
        sys.stderr.write(f"llmsvc serve: error: {env}={v!r}: {e}\n")
        raise SystemExit(2) from None
