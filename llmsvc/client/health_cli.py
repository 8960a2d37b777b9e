"""`llmsvc health`: grpc.health.v1 Check; exit 0 iff SERVING (for container healthchecks).

Exit codes: 0 SERVING; 1 any other status (NOT_SERVING, UNKNOWN, SERVICE_UNKNOWN);
2 the check itself failed (unreachable, deadline, unknown service name).
"""
from __future__ import annotations

import argparse

from llmsvc.client.cli_common import (add_connection_arguments, channel_options_from_args, credentials_from_args,
                                      print_error)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_connection_arguments(parser, token=False, timeout=5.0)
    parser.add_argument("--service", default="",
                        help='service name to check: "" (the process, default) or llmsvc.v1.LlmService')


def main(args: argparse.Namespace) -> int:
    from llmsvc.client.client import Client
    from llmsvc.client.errors import LlmsvcError

    try:
        with Client(args.server, timeout=args.timeout, credentials=credentials_from_args(args, "llmsvc health"),
                    options=channel_options_from_args(args)) as client:
            status = client.health(args.service)
    except LlmsvcError as err:
        print_error("llmsvc health", err)
        return 2
    print(status)
    return 0 if status == "SERVING" else 1
