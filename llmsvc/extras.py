"""Which of the `server` extra's packages this install lacks: the base install is the client
(gRPC and protobuf), and what runs a model (`llmsvc serve`, `llmsvc bench`, the offline LLM)
says how to get the rest instead of failing on an import deep inside."""
from __future__ import annotations

import importlib.util

SERVER_MODULES = ("torch", "transformers", "safetensors", "zmq", "prometheus_client")  # a few of the extra's
INSTALL_HINT = "pip install 'llmsvc[server]' (from this repository: make serve)"


def missing_server_modules() -> list[str]:
    return [m for m in SERVER_MODULES if importlib.util.find_spec(m) is None]


def require_server_extra(what: str) -> None:
    """ImportError naming `what`, the missing packages and the install command, if any is missing."""
    missing = missing_server_modules()
    if missing:
        raise ImportError(f"{what} needs the server's dependencies ({', '.join(missing)} not installed): "
                          f"{INSTALL_HINT}")
