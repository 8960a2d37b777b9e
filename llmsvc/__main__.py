"""`llmsvc` console script: one sub-command per module, imported only when used.

Each command module provides `add_arguments(parser)` and `main(args) -> int`. The client
commands run on the base install (gRPC and protobuf only); `serve` and `bench` need the
`server` extra, and say so instead of failing on an import deep inside.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

from llmsvc.extras import require_server_extra
from llmsvc.version import installed_version

# gRPC's C core writes its own lines to stderr (a failed TLS handshake at INFO, each time a
# probe speaks plaintext), outside the server's log format: only its errors, unless the
# operator asks for more. Read once, when grpc is first imported: before any import of it.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

COMMANDS = {
    "serve": ("llmsvc.server.cli", "start the gRPC server (default model when MODEL is omitted)"),
    "generate": ("llmsvc.client.cli", "send one prompt to a running server and print the completion"),
    "health": ("llmsvc.client.health_cli", "grpc.health.v1 probe (exit 0 when SERVING): for container healthchecks"),
    "admin": ("llmsvc.client.admin_cli",
              "AdminService calls with an admin token: drain, flush-cache, load-lora, unload-lora"),
    "bench": ("llmsvc.bench.cli", "benchmark offline or over gRPC; the packaged standard workloads or custom ones"),
}
SERVER_COMMANDS = ("serve", "bench")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="llmsvc", description="LLM inference engine served over gRPC")
    parser.add_argument("--version", action="version", version=f"llmsvc {installed_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    name = argv[0] if argv and argv[0] in COMMANDS else None
    if name in SERVER_COMMANDS and "-h" not in argv and "--help" not in argv:
        try:
            require_server_extra(f"llmsvc {name}")
        except ImportError as e:
            print(e, file=sys.stderr)
            return 2
    for cmd, (_, help_) in COMMANDS.items():
        p = sub.add_parser(cmd, help=help_)
        if cmd == name:  # only the chosen command's module (and its dependencies) is imported
            module = importlib.import_module(COMMANDS[cmd][0])
            module.add_arguments(p)
            p.set_defaults(_module=module)
    args = parser.parse_args(argv)
    return int(args._module.main(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
