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
from llmsvc.client.cli_common import (INT32, UINT32, UINT64, add_connection_arguments, channel_options_from_args,
                                      credentials_from_args, int_in, print_error, read_file, readable_file,
                                      usage_error)

PROG = "llmsvc generate"

# flag dest == proto field name; passed to Client.generate only when given. Integer types are
# the proto field's range: limits that depend on the model or server are the server's to check.
_FIELD_FLAGS: tuple[tuple[str, Callable[[str], object], str], ...] = (
    ("max_tokens", UINT32, "maximum generated tokens (default: fill the context)"),
    ("min_tokens", UINT32, "minimum generated tokens before a stop may end the output"),
    ("temperature", float, "0 = greedy"),
    ("top_p", float, "nucleus mass in (0, 1]"),
    ("top_k", INT32, "keep the k most likely tokens (0/-1: off)"),
    ("min_p", float, "minimum probability relative to the top token"),
    ("presence_penalty", float, "[-2, 2]"),
    ("frequency_penalty", float, "[-2, 2]"),
    ("repetition_penalty", float, "> 0, 1 = off"),
    ("seed", UINT64, "sampling seed"),
    ("n", UINT32, "number of parallel samples"),
    ("logprobs", UINT32, "return logprobs of sampled tokens plus the top N"),
    ("priority", INT32, "lower runs sooner"),
    ("truncate_prompt_tokens", UINT32, "keep only the last N prompt tokens"),
    ("cache_salt", str, "share cached prompt blocks only with requests of this salt"),
    ("lora_name", str, "run with this served LoRA adapter (the server's --lora-modules)"),
    ("time_limit_ms", UINT32, "graceful time limit (finish reason time_limit)"),
    ("stream_interval", int_in(1, 2**32 - 1),
     "with --stream: new tokens per message (at least the server's --stream-interval)"),
)


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
    for name, typ, help_ in _FIELD_FLAGS:
        parser.add_argument("--" + name.replace("_", "-"), dest=name, type=typ, default=None, help=help_)
    parser.add_argument("--stop", action="append", default=None, metavar="S",
                        help="stop string (repeatable)")
    parser.add_argument("--stop-token-id", dest="stop_token_ids", action="append", type=UINT32,
                        default=None, metavar="ID", help="stop token id (repeatable)")
    parser.add_argument("--allowed-token-id", dest="allowed_token_ids", action="append", type=UINT32,
                        default=None, metavar="ID", help="sample only among these token ids (repeatable)")
    parser.add_argument("--bad-word", dest="bad_words", action="append", default=None, metavar="W",
                        help="a word never to generate (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true", default=None, help="keep going past EOS")
    parser.add_argument("--include-stop-str", dest="include_stop_str_in_output", action="store_true",
                        default=None, help="keep the matched stop string in the output")


def request_kwargs(args: argparse.Namespace) -> dict:
    """The Client.generate keyword arguments the flags ask for (unset flags are left out)."""
    names = [name for name, _, _ in _FIELD_FLAGS]
    names += ["stop", "stop_token_ids", "allowed_token_ids", "bad_words", "ignore_eos", "include_stop_str_in_output"]
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
