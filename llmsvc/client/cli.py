"""`llmsvc generate "prompt" --server HOST:PORT [--stream] [sampling flags]`.

Prints the completion (with --stream: the text as it arrives). --json prints the final result
as one JSON object, or with --stream one JSON object per GenerateResponse. On an error the
status code and message go to stderr and the exit code is 1 (130 on Ctrl-C).
"""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

from llmsvc.client.channel import MAX_RETRIES
from llmsvc.sampling_fields import declared
from llmsvc.sampling_params import SamplingParams
from llmsvc.client.cli_common import (INT32, UINT32, UINT64, add_connection_arguments, channel_options_from_args,
                                      credentials_from_args, int_in, print_error, read_file, readable_file,
                                      usage_error)

PROG = "llmsvc generate"

# The sampling flags come from SamplingParams' own declarations (llmsvc.sampling_fields): a flag's
# dest is the proto field's name; passed to Client.generate only when given. Integer types are
# the proto field's range: limits that depend on the model or server are the server's to check.
_CLI_TYPES: dict[str, Callable[[str], object]] = {
    "float": float, "int32": INT32, "uint32": UINT32, "uint64": UINT64, "str": str}


def _flag_type(facts) -> Callable[[str], object]:
    """The flag's parser: the proto type's range, narrowed to the field's own lower bound where
    it has one above 0 (max_tokens >= 1), so the CLI refuses what the server would."""
    if facts.cli == "uint32" and facts.lo is not None and facts.lo > 0:
        return int_in(int(facts.lo), 2**32 - 1)
    return _CLI_TYPES[facts.cli]
_SAMPLING_FLAGS = tuple((f.name, facts) for f, facts in declared(SamplingParams) if facts.cli)
# request fields that are not sampling parameters
_REQUEST_FLAGS: tuple[tuple[str, Callable[[str], object], str], ...] = (
    ("priority", INT32, "lower runs sooner"),
    ("truncate_prompt_tokens", UINT32, "keep only the last N prompt tokens"),
    ("cache_salt", str, "share cached prompt blocks only with requests of this salt"),
    ("lora_name", str, "run with this served LoRA adapter (the server's --lora-modules)"),
)


def _add_sampling_flags(parser: argparse.ArgumentParser) -> None:
    for name, facts in _SAMPLING_FLAGS:
        flag = facts.flag or "--" + name.replace("_", "-")
        if facts.cli == "bool":
            parser.add_argument(flag, dest=name, action="store_true", default=None, help=facts.help)
        elif facts.repeated:
            parser.add_argument(flag, dest=name, action="append", type=_flag_type(facts), default=None,
                                metavar=flag.split("-")[-1][0].upper() if facts.cli == "str" else "ID",
                                help=facts.help)
        else:
            parser.add_argument(flag, dest=name, type=_flag_type(facts), default=None, help=facts.help)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help='prompt text ("-" reads stdin)')
    add_connection_arguments(parser)
    parser.add_argument("--stream", action="store_true", help="print tokens as they arrive")
    parser.add_argument("--chat", action="store_true",
                        help="send the prompt as a user chat message (the model's chat template applies)")
    parser.add_argument("--system", default=None, help="system message (with --chat)")
    parser.add_argument("--tools", type=readable_file, default=None, metavar="FILE",
                        help="with --chat: a JSON file holding a list of OpenAI function tools for the template")
    parser.add_argument("--chat-template-kwargs", default=None, metavar="JSON",
                        help='with --chat: extra chat-template variables, e.g. \'{"enable_thinking": false}\'')
    parser.add_argument("--json", action="store_true", help="machine-readable JSON output")
    parser.add_argument("--request-id", default=None, help="request id (default: made by the server)")
    parser.add_argument("--max-retries", type=int_in(0, MAX_RETRIES), default=0, metavar="N",
                        help=f"retry up to N (0-{MAX_RETRIES}) times, after the server's delay, when it refuses "
                             "the call before starting it: queue full, loading, draining (default: 0)")
    for name, typ, help_ in _REQUEST_FLAGS:
        parser.add_argument("--" + name.replace("_", "-"), dest=name, type=typ, default=None, help=help_)
    _add_sampling_flags(parser)


def request_kwargs(args: argparse.Namespace) -> dict:
    """The Client.generate keyword arguments the flags ask for (unset flags are left out)."""
    names = [name for name, _, _ in _REQUEST_FLAGS] + [name for name, _ in _SAMPLING_FLAGS]
    kwargs = {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}
    if args.chat:
        messages = [{"role": "system", "content": args.system}] if args.system else []
        kwargs["messages"] = messages + [{"role": "user", "content": args.prompt}]
        if args.tools:
            kwargs["tools"] = _json_arg("--tools", read_file(args.tools), list)
        if args.chat_template_kwargs:
            kwargs["chat_template_kwargs"] = _json_arg("--chat-template-kwargs", args.chat_template_kwargs, dict)
    else:
        for flag, value in (("--system", args.system), ("--tools", args.tools),
                            ("--chat-template-kwargs", args.chat_template_kwargs)):
            if value:
                usage_error(PROG, f"{flag} needs --chat")
        kwargs["prompt"] = args.prompt
    return kwargs


def _json_arg(flag: str, text: str | bytes, kind: type):
    try:
        value = json.loads(text)
    except ValueError as e:
        usage_error(PROG, f"{flag}: not JSON: {e}")
    if not isinstance(value, kind):
        usage_error(PROG, f"{flag}: must be a JSON {'list' if kind is list else 'object'}")
    return value


def _result_json(result) -> dict:
    from google.protobuf import json_format

    def msg(m):
        return json_format.MessageToDict(m, preserving_proto_field_name=True) if m is not None else None

    return {
        "request_id": result.request_id,
        "prompt": msg(result.prompt),
        "outputs": [
            {"index": o.index, "text": o.text, "token_ids": o.token_ids,
             "finish_reason": o.finish_reason, "finish": msg(o.finish),
             "logprobs": [msg(lp) for lp in o.logprobs]}
            for o in result.outputs
        ],
    }


def _run(client, args, kwargs, out) -> None:
    if not args.stream:
        result = client.generate(request_id=args.request_id, **kwargs)
        if args.json:
            print(json.dumps(_result_json(result), ensure_ascii=False), file=out)
        else:
            for o in result.outputs:
                header = f"--- [{o.index}] ---\n" if len(result.outputs) > 1 else ""
                print(header + o.text, file=out)
        return
    stream = client.generate_stream(request_id=args.request_id, **kwargs)
    if args.json:
        from google.protobuf import json_format

        for msg in stream:
            line = json_format.MessageToDict(msg, preserving_proto_field_name=True)
            print(json.dumps(line, ensure_ascii=False), file=out, flush=True)
        return
    many = (args.n or 1) > 1
    written = False
    try:
        for msg in stream:
            if not many and msg.text:
                out.write(msg.text)
                out.flush()
                written = True
    except BaseException:
        if written:  # the partial text ends its line; the error follows on the next
            out.write("\n")
            out.flush()
        raise
    if many:  # interleaved deltas: print each output once it is complete
        for o in stream.result.outputs:
            print(f"--- [{o.index}] ---\n{o.text}", file=out)
    else:
        out.write("\n")
        out.flush()


def main(args: argparse.Namespace) -> int:
    from llmsvc.client.client import Client
    from llmsvc.client.errors import LlmsvcError

    if args.prompt == "-":
        args.prompt = sys.stdin.read()
    try:
        kwargs = request_kwargs(args)
        with Client(args.server, timeout=args.timeout, credentials=credentials_from_args(args, PROG),
                    options=channel_options_from_args(args), token=args.token,
                    max_retries=args.max_retries) as client:
            _run(client, args, kwargs, sys.stdout)
    except LlmsvcError as err:
        print_error(PROG, err)
        return 1
    except (TypeError, ValueError) as err:  # a value the client library refuses that the flag types let through
        print(f"{PROG}: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0
