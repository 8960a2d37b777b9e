"""`llmsvc admin drain|flush-cache|load-lora|unload-lora`: the AdminService calls, with an admin token.

    llmsvc admin --server HOST:PORT --token ADMIN_TOKEN drain [--grace S]
    llmsvc admin --token ADMIN_TOKEN flush-cache
    llmsvc admin --token ADMIN_TOKEN load-lora NAME PATH | unload-lora NAME

The token also comes from LLMSVC_ADMIN_TOKEN. Exit codes: 0 done; 1 the server refused
(PERMISSION_DENIED, UNAUTHENTICATED, FAILED_PRECONDITION...); 2 it could not be reached.
"""
from __future__ import annotations

import argparse
import json
import os

from llmsvc.client.cli_common import (add_connection_arguments, channel_options_from_args, credentials_from_args,
                                      print_error)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_connection_arguments(parser, token=False, timeout=30.0)
    parser.add_argument("--token", default=os.environ.get("LLMSVC_ADMIN_TOKEN"),
                        help="admin bearer token (env LLMSVC_ADMIN_TOKEN)")
    actions = parser.add_subparsers(dest="action", required=True)
    drain = actions.add_parser("drain", help="graceful shutdown: in-flight requests finish, new ones are refused")
    drain.add_argument("--grace", type=float, default=None, metavar="S",
                       help="seconds in-flight requests get (default: the server's --shutdown-grace)")
    actions.add_parser("flush-cache", help="empty the prefix cache (refused while requests hold KV blocks)")
    load = actions.add_parser("load-lora", help="load a LoRA adapter (a PEFT directory the server can read)")
    load.add_argument("name")
    load.add_argument("path")
    unload = actions.add_parser("unload-lora", help="unload a LoRA adapter (refused while requests use it)")
    unload.add_argument("name")


def main(args: argparse.Namespace) -> int:
    from llmsvc.client.client import Client
    from llmsvc.client.errors import DeadlineExceeded, LlmsvcError, Unavailable

    try:
        with Client(args.server, timeout=args.timeout, credentials=credentials_from_args(args, "llmsvc admin"),
                    options=channel_options_from_args(args),
                    token=args.token) as client:
            if args.action == "drain":
                r = client.drain(args.grace)
                print(json.dumps({"draining": True, "already_draining": r.already_draining,
                                  "grace_seconds": r.grace_seconds, "num_running": r.num_running,
                                  "num_waiting": r.num_waiting}))
            elif args.action == "load-lora":
                a = client.load_lora_adapter(args.name, args.path)
                print(json.dumps({"loaded": a.name, "path": a.path, "rank": a.rank}))
            elif args.action == "unload-lora":
                client.unload_lora_adapter(args.name)
                print(json.dumps({"unloaded": args.name}))
            else:
                client.flush_cache()
                print(json.dumps({"flushed": True}))
    except (Unavailable, DeadlineExceeded) as err:
        print_error(f"llmsvc admin {args.action}", err)
        return 2
    except LlmsvcError as err:
        print_error(f"llmsvc admin {args.action}", err)
        return 1
    return 0
