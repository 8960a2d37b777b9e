"""Flags shared by the client CLIs (`llmsvc generate`, `llmsvc health`, `llmsvc admin`), and the
argparse value types that refuse what can never be valid before anything is sent."""
from __future__ import annotations

import argparse
import math
import os
import sys

DEFAULT_SERVER = "localhost:50051"


def int_in(lo: int, hi: int | None = None):
    """An argparse type: an integer in [lo, hi] (hi None: no upper bound)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid integer: {text!r}") from None
        if value < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {value}")
        if hi is not None and value > hi:
            raise argparse.ArgumentTypeError(f"must be <= {hi}, got {value}")
        return value
    return parse


# the proto field types the flags fill: a value outside them can only fail in protobuf, unnamed
UINT32 = int_in(0, 2**32 - 1)
UINT64 = int_in(0, 2**64 - 1)
INT32 = int_in(-2**31, 2**31 - 1)


def positive_float(text: str) -> float:
    """An argparse type: a finite number > 0 (a duration or a rate)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number: {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def readable_file(path: str) -> str:
    """An argparse type: the path of a file this process can read, so that a missing one is
    reported with its flag before any work starts (it is read again where it is used)."""
    try:
        with open(os.path.expanduser(path), "rb"):
            pass
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot read {path}: {e.strerror or e}") from None
    return path


def read_file(path: str) -> bytes:
    with open(os.path.expanduser(path), "rb") as f:
        return f.read()


def default_server() -> str:
    """LLMSVC_SERVER, else 127.0.0.1 at the server's own LLMSVC_PORT (a container's healthcheck
    runs with the server's environment), else DEFAULT_SERVER."""
    if os.environ.get("LLMSVC_SERVER"):
        return os.environ["LLMSVC_SERVER"]
    port = os.environ.get("LLMSVC_PORT", "").strip()
    return f"127.0.0.1:{port}" if port.isdigit() else DEFAULT_SERVER


def add_connection_arguments(parser: argparse.ArgumentParser, *, token: bool = True,
                             timeout: float | None = None) -> None:
    parser.add_argument("--server", default=default_server(),
                        help="HOST:PORT of the llmsvc server (env LLMSVC_SERVER; else 127.0.0.1 on the port "
                             "LLMSVC_PORT gives the server beside it, as in its container; default %(default)s)")
    parser.add_argument("--timeout", type=positive_float, default=timeout, metavar="S",
                        help="deadline for the call, seconds (default: %(default)s)")
    parser.add_argument("--tls-ca", type=readable_file, default=None, metavar="FILE",
                        help="use TLS, trusting the PEM root certificates in FILE")
    parser.add_argument("--tls-cert", type=readable_file, default=None, metavar="FILE",
                        help="PEM client certificate for mTLS (with --tls-key and --tls-ca)")
    parser.add_argument("--tls-key", type=readable_file, default=None, metavar="FILE",
                        help="PEM private key of --tls-cert")
    parser.add_argument("--tls-server-name", default=None, metavar="NAME",
                        help="the name the server's certificate must carry, when --server gives another "
                             "(e.g. 127.0.0.1 inside the container of a server whose certificate names its DNS name)")
    if token:
        parser.add_argument("--token", default=os.environ.get("LLMSVC_TOKEN"),
                            help="bearer token sent as `authorization` metadata (env LLMSVC_TOKEN)")


def usage_error(prog: str, message: str):
    """Flags that parse but do not go together: argparse's form of a usage error, exit code 2."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def credentials_from_args(args: argparse.Namespace, prog: str = "llmsvc"):
    """None (plaintext), the CA file path (TLS), or mTLS channel credentials."""
    cert, key = getattr(args, "tls_cert", None), getattr(args, "tls_key", None)
    if not (cert or key):
        return args.tls_ca
    if not (cert and key and args.tls_ca):
        usage_error(prog, "--tls-cert and --tls-key go together, and need --tls-ca")
    import grpc

    return grpc.ssl_channel_credentials(read_file(args.tls_ca), read_file(key), read_file(cert))


def channel_options_from_args(args: argparse.Namespace) -> tuple:
    """Channel options the connection flags ask for (--tls-server-name)."""
    name = getattr(args, "tls_server_name", None)
    return (("grpc.ssl_target_name_override", name),) if name else ()


def print_error(prog: str, err) -> None:
    """One line `prog: CODE: message`, then any field violations the message does not already
    state, on stderr."""
    text = str(err)
    print(f"{prog}: {text}", file=sys.stderr)
    for field, description in getattr(err, "field_violations", []):
        # stated as "field: description", or as the whole message (NOT_FOUND's, without the field)
        if f"{field}: {description}" not in text and text.split(": ", 1)[-1] != description:
            print(f"  {field}: {description}", file=sys.stderr)
