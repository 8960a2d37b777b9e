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
    parser.add_argument("--tls-cert", default=None, metavar="FILE",
                        help="PEM client certificate for mTLS (with --tls-key and --tls-ca)")
    parser.add_argument("--tls-key", default=None, metavar="FILE", help="PEM private key of --tls-cert")
    if token:
        parser.add_argument("--token", default=os.environ.get("LLMSVC_TOKEN"),
                            help="bearer token sent as `authorization` metadata (env LLMSVC_TOKEN)")


def credentials_from_args(args: argparse.Namespace):
    """None (plaintext), the CA file path (TLS), or mTLS channel credentials."""
    cert, key = getattr(args, "tls_cert", None), getattr(args, "tls_key", None)
    if not (cert or key):
        return args.tls_ca
    if not (cert and key and args.tls_ca):
        raise SystemExit("--tls-cert and --tls-key go together, and need --tls-ca")
    import grpc

    def read(path: str) -> bytes:
        with open(os.path.expanduser(path), "rb") as f:
            return f.read()

    return grpc.ssl_channel_credentials(read(args.tls_ca), read(key), read(cert))


def print_error(prog: str, err) -> None:
    """One line `prog: CODE: message`, then any field violations the message does not already
    state, on stderr."""
    print(f"{prog}: {err}", file=sys.stderr)
    for field, description in getattr(err, "field_violations", []):
        if f"{field}: {description}" not in str(err):
            print(f"  {field}: {description}", file=sys.stderr)
