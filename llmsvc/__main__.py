"""`llmsvc` console script: one sub-command per module, imported only when used.

Each command module provides `add_arguments(parser)` and `main(args) -> int`.
"""
from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {
    "serve": ("llmsvc.server.cli", "start the gRPC server (default model when MODEL is omitted)"),
    "generate": ("llmsvc.client.cli", "send one prompt to a running server and print the completion"),
    "health": ("llmsvc.client.health_cli", "grpc.health.v1 probe (exit 0 when SERVING): for container healthchecks"),
    "admin": ("llmsvc.client.admin_cli", "AdminService calls with an admin token: drain, flush-cache"),
    "bench": ("llmsvc.bench.cli", "benchmark offline or over gRPC; the packaged standard workloads or custom ones"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="llmsvc", description="LLM inference engine served over gRPC")
    sub = parser.add_subparsers(dest="command", required=True)
    name = argv[0] if argv and argv[0] in COMMANDS else None
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
