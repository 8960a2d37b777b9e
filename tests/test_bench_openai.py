"""`llmsvc bench --openai [NAME=]URL`: the streamed chat client against a local fake OpenAI
endpoint (no timing thresholds: only what was counted and sent), the flag's parsing, and one
whole bench run beside a real (tiny) `llmsvc serve`. The same client through the real SMG
gateway is in tests/test_smg_gateway.py."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from llmsvc.bench.openai_chat import chat_body, chat_chunk, flush_cache, run_chat, served_model
from llmsvc.bench.openai_peer import ChatPrompts, Endpoint, check_endpoints, parse_endpoint
from llmsvc.bench.server_proc import free_port

ROOT = Path(__file__).resolve().parents[1]


class ChatHandler(BaseHTTPRequestHandler):
    """GET /v1/models; POST /flush_cache; POST /v1/chat/completions streams max_tokens tokens as
    SSE chunks, the last `packed` of them two to a chunk, then a usage chunk. A message "refuse"
    gets HTTP 400. Class attributes (per test subclass) configure it and collect what it got."""
    first_delay, packed, flushes, bodies = 0.1, 2, [], []

    def log_message(self, *args) -> None:
        pass

    def _json(self, status: int, obj) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self._json(200, {"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.path == "/flush_cache":
            type(self).flushes.append(time.monotonic())
            return self._json(200, {})
        req = json.loads(body)
        type(self).bodies.append(req)
        if req["messages"][0]["content"] == "refuse":
            return self._json(400, {"error": {"message": "refused"}})
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        time.sleep(self.first_delay)
        n = req["max_tokens"]
        sizes = [1] * (n - 2 * self.packed) + [2] * self.packed
        for k, size in enumerate(sizes):
            chunk = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "ab"[:size]}}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()
        usage = {"prompt_tokens": 9, "completion_tokens": n, "prompt_tokens_details": {"cached_tokens": 4}}
        self.wfile.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode())


@pytest.fixture
def fake_endpoint():
    class Handler(ChatHandler):
        flushes, bodies = [], []

    server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", Handler
    finally:
        server.shutdown()
        server.server_close()


def test_chat_stream_counts_every_token_and_fails_a_refused_request(fake_endpoint):
    url, handler = fake_endpoint
    assert served_model(url) == "fake-model" and flush_cache(url) and len(handler.flushes) == 1
    texts = ["hello there", "second prompt", "refuse"]
    recs, wall = run_chat(url, "fake-model", texts, [11, 12, 13], 7, [0.0, 0.02, 0.04])
    assert [r.output_len for r in recs[:2]] == [7, 7]  # 3 single chunks + 2 double: usage fills the count
    assert recs[2].error.startswith("HTTP 400") and recs[2].output_len == 0
    assert [r.prompt_len for r in recs] == [11, 12, 13] and [r.cached_tokens for r in recs[:2]] == [4, 4]
    for r in recs[:2]:
        assert handler.first_delay <= r.ttft <= r.end - r.start <= wall
        assert r.token_times == sorted(r.token_times) and r.token_times[-1] == r.token_times[-2]  # packed
    assert sorted(b["messages"][0]["content"] for b in handler.bodies) == sorted(texts)
    body = next(b for b in handler.bodies if b["messages"][0]["content"] == "hello there")
    assert body == chat_body("fake-model", "hello there", 7)
    assert body["ignore_eos"] and body["min_tokens"] == body["max_tokens"] == 7 and body["temperature"] == 0


def test_chat_chunk_reads_text_usage_and_errors():
    assert chat_chunk(json.dumps({"choices": [{"delta": {"content": "ab"}}]})) == (1, None, None)
    assert chat_chunk(json.dumps({"choices": [{"delta": {"role": "assistant"}}]})) == (0, None, None)
    assert chat_chunk(json.dumps({"choices": [{"delta": {"reasoning_content": "hm"}}]}))[0] == 1
    assert chat_chunk(json.dumps({"choices": [], "usage": {"completion_tokens": 5}})) == (0, 5, None)
    with pytest.raises(ValueError, match="bad"):
        chat_chunk(json.dumps({"error": {"message": "bad"}}))


def test_endpoint_flag_names_and_refusals():
    assert parse_endpoint("smg-llmsvc=http://127.0.0.1:8000/") == Endpoint("smg-llmsvc", "http://127.0.0.1:8000")
    assert parse_endpoint("http://127.0.0.1:8001") == Endpoint("127.0.0.1:8001", "http://127.0.0.1:8001")
    for bad in ("127.0.0.1:8000", "x=ftp://h:1", "x="):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_endpoint(bad)
    assert check_endpoints([Endpoint("a", "http://h:1"), Endpoint("b", "http://h:2")]) is None
    assert "'a' given twice" in check_endpoints([Endpoint("a", "http://h:1"), Endpoint("a", "http://h:2")])


def test_chat_prompts_are_the_templates_rendering_of_the_decoded_prompt():
    from tests.server_harness import IM_END, IM_START, tiny_tokenizer

    chat = ChatPrompts(tiny_tokenizer())
    texts = chat.texts([[104, 105], [120, 121, 122]])
    assert texts == ["hi", "xyz"]
    rendered = chat.rendered(texts)
    assert rendered[0] == [IM_START, *b"user\nhi", IM_END, *b"\n", IM_START, *b"assistant\n"]


def test_bench_measures_an_openai_endpoint_beside_our_grpc_run(fake_endpoint, tmp_path):
    from tests.server_harness import make_tiny_served_model_dir

    url, handler = fake_endpoint
    d = make_tiny_served_model_dir(tmp_path / "m")
    out = tmp_path / "r.json"
    r = subprocess.run([sys.executable, "-m", "llmsvc", "bench", str(d), "--num-requests", "3", "--input-len", "8",
                        "--output-len", "4", "--openai", f"fake={url}", "--json", str(out),
                        "--kv-cache-memory", "8MiB"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())["workloads"]["custom"]
    fake, ours = res["openai:fake"], res["serve"]
    assert fake["completed"] == ours["completed"] == 3 and fake["failed"] == 0
    assert fake["output_tok_s"] * fake["wall_s"] == pytest.approx(12)
    # the same prompt tokens on both: our gRPC run got each text rendered by the chat template
    assert fake["prompt_tokens"] == ours["prompt_tokens"] > 3 * 8
    assert len(handler.bodies) == 4 and len(handler.flushes) == 1  # a warm-up, then the 3 measured
    assert handler.bodies[0]["max_tokens"] == 2 and handler.flushes[0] > 0
    assert set(res["openai_ratios"]) == {"fake / llmsvc gRPC"}
    assert "fake (OpenAI chat)" in r.stdout and "fake / llmsvc gRPC: output tok/s" in r.stdout
