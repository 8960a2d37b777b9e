"""Connection flags shared by the client CLIs (`llmsvc generate`, `llmsvc health`)."""
from __future__ import annotations

import argparse
import os
import sys

DEFAULT_SERVER = "localhost:50051"


def add_connection_arguments(parser: argparse.ArgumentParser, *, token: bool = True,
                             timeout: float | None = None) -> None:
    parser.add_argument("--server", default=os.environ.get("LLMSVC_SERVER", DEFAULT_SERVER),
                        help="HOST:PORT of the llmsvc server (env LLMSVC_SERVER; default %(default)s)")
    parser.add_argument("--timeout", type=float, default=timeout, metavar="S",
                        help="deadline for the call, seconds (default: %(default)s)")
    parser.add_argument("--tls-ca", default=None, metavar="FILE",
                        help="use TLS, trusting the PEM root certificates in FILE")
    if token:
        parser.add_argument("--token", default=os.environ.get("LLMSVC_TOKEN"),
                            help="bearer token sent as `authorization` metadata (env LLMSVC_TOKEN)")


def print_error(prog: str, err) -> None:
    """One line `prog: CODE: message`, then any field violations, on stderr."""
    print(f"{prog}: {err}", file=sys.stderr)
    for field, description in getattr(err, "field_violations", []):
        print(f"  {field}: {description}", file=sys.stderr)
