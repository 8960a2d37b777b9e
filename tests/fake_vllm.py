"""A test fake standing in for vLLM's interpreter in `llmsvc bench --baseline vllm` tests; it
measures nothing. Run as `python fake_vllm.py ARGS` it answers what llmsvc.bench.vllm_peer
asks of that interpreter:
  -c "import vllm; ..."                       prints a version
  .../vllm_offline.py --model M ...           the offline protocol, with made-up fixed timings
  -m vllm.entrypoints.openai.api_server ...   /health, streaming /v1/completions and (in dev mode,
                                              VLLM_SERVER_DEV_MODE=1) /reset_prefix_cache on loopback
FAKE_VLLM_LOG, if set, names a file each start (and each cache reset) appends its mode and pid
to; FAKE_VLLM_FIRST_DELAY delays the server's first chunk by that many seconds."""
from __future__ import annotations

import json
import os
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

VERSION = "0.0-fake"
OFFLINE_WALL_S = 0.5  # every offline job "takes" this long
TOKEN_ID = 7


def offline_result(prompts: list[list[int]], max_tokens: int) -> dict:
    """Request i: first token after 10 * (i + 1) ms, the rest over 100 ms."""
    return {"wall_s": OFFLINE_WALL_S, "ttft_source": "fake",
            "records": [{"prompt_len": len(p), "output_len": max_tokens, "ttft_s": 0.01 * (i + 1),
                         "decode_s": 0.1} for i, p in enumerate(prompts)]}


class CompletionsHandler(BaseHTTPRequestHandler):
    """GET /health; POST /v1/completions streams max_tokens tokens, `tokens_per_chunk` a chunk,
    after `first_delay` seconds. Prompts longer than `max_prompt` get HTTP 400."""
    protocol_version = "HTTP/1.0"  # the stream ends when the connection closes
    first_delay = 0.0
    tokens_per_chunk = 1
    max_prompt = 1 << 20
    bodies: list = []

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def do_POST(self) -> None:
        if self.path == "/reset_prefix_cache":  # vLLM registers it in dev mode only
            dev = os.environ.get("VLLM_SERVER_DEV_MODE") == "1"
            if dev:
                _log("reset")
            self.send_response(200 if dev else 404)
            self.end_headers()
            return
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).bodies.append(body)
        if len(body["prompt"]) > self.max_prompt:
            self.send_response(400)
            self.end_headers()
            self.wfile.write(b'{"error": "prompt too long"}')
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        time.sleep(self.first_delay)
        left = body["max_tokens"]
        self.wfile.write(b": a comment line\n\n")
        while left > 0:
            n = min(self.tokens_per_chunk, left)
            left -= n
            chunk = {"object": "text_completion", "choices": [{"index": 0, "text": "x" * n,
                                                                 "token_ids": [TOKEN_ID] * n}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()
        self.wfile.write(b"data: [DONE]\n\n")


def serve(port: int, handler=CompletionsHandler) -> ThreadingHTTPServer:
    return ThreadingHTTPServer(("127.0.0.1", port), handler)


def _log(mode: str) -> None:
    if os.environ.get("FAKE_VLLM_LOG"):
        with open(os.environ["FAKE_VLLM_LOG"], "a") as f:
            f.write(f"{mode} {os.getpid()}\n")


def main(argv: list[str]) -> int:
    if argv[:1] == ["-c"]:
        print(VERSION)
        return 0
    if argv[:2] == ["-m", "vllm.entrypoints.openai.api_server"]:
        _log("server")

        class Handler(CompletionsHandler):
            first_delay = float(os.environ.get("FAKE_VLLM_FIRST_DELAY", "0"))

        serve(int(argv[argv.index("--port") + 1]), Handler).serve_forever()
        return 0
    if argv and argv[0].endswith("vllm_offline.py"):
        _log("offline")
        print(json.dumps({"ready": True, "vllm_version": VERSION}), flush=True)
        for line in sys.stdin:
            job = json.loads(line)
            print(json.dumps(offline_result(job["prompts"], job["max_tokens"])), flush=True)
        return 0
    print(f"fake vllm: unexpected arguments {argv}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
