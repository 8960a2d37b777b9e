"""The real SMG gateway (`smg launch`, the test extra's pinned wheel) in front of two real
`llmsvc serve` replicas of a tiny random Llama, all on loopback: OpenAI's API works through
vllm.grpc.engine.VllmEngine, greedy tokens equal our own API's, a client that goes away frees
its KV blocks, and requests sharing a prefix land on the replica that caches it (cache_aware).

The tiny model's tokenizer maps token id i < 256 to byte i, so a token's bytes (in OpenAI's
logprobs) name its id. Failover and drain behind the gateway: tests/test_smg_failover.py."""
from __future__ import annotations

import http.client
import json
import re
import time

import grpc
import jsonschema
import pytest

from llmsvc.v1 import llmsvc_pb2 as v1
from llmsvc.v1 import llmsvc_pb2_grpc as v1_grpc
from tests.ascii_model import ascii_tokenizer, make_ascii_served_model_dir
from tests.smg_utils import open_stream, smg_fleet, sse_events

MESSAGES = [{"role": "user", "content": "hello there"}]
TOKEN_IDS = {ascii_tokenizer().decode([i]): i for i in range(259)}  # every token's text is its own


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    d = make_ascii_served_model_dir(tmp_path_factory.mktemp("smg"), max_position_embeddings=4096)
    with smg_fleet(d, replicas=2) as f:
        yield f


def chat(fleet, **kw) -> dict:
    status, body = fleet.post("/v1/chat/completions", {"model": fleet.model, "messages": MESSAGES, **kw})
    assert status == 200, body
    return body


def stream_text(events: list[dict], index: int = 0) -> str:
    out = []
    for e in events:
        for c in e.get("choices") or []:
            if c["index"] == index:
                out.append((c.get("delta") or {}).get("content") or c.get("text") or "")
    return "".join(out)


def finish_reasons(events: list[dict]) -> list[str]:
    return [c["finish_reason"] for e in events for c in e.get("choices") or [] if c.get("finish_reason")]


def token_ids(choice: dict) -> list[int]:
    """The generated ids, from the token texts of a choice's logprobs."""
    return [TOKEN_IDS[t["token"]] for t in choice["logprobs"]["content"]]


def served(fleet) -> list[float]:
    """Generate calls each replica has completed on the engine door (its own metrics)."""
    key = 'llmsvc_grpc_requests_total{code="OK",method="Generate",service="vllm.grpc.engine.VllmEngine"}'
    return [r.metrics().get(key, 0.0) for r in fleet.replicas]


def test_models_and_both_workers_registered(fleet):
    status, body = fleet.get("/v1/models")
    assert status == 200 and [m["id"] for m in body["data"]] == [fleet.model]
    assert fleet.gateway.workers_healthy() == 2
    status, workers = fleet.get("/workers")
    assert {w["url"] for w in workers["workers"]} == {r.url for r in fleet.replicas}
    assert {w["connection_mode"] for w in workers["workers"]} == {"grpc"}


def test_an_http_probe_of_a_replica_fails_so_discovery_registers_it_as_grpc(fleet):
    """SMG's Kubernetes discovery (deploy/k8s/smg.yaml) registers a pod by bare host:port and
    probes it over HTTP (GET /health) and gRPC at once, HTTP winning when both answer. Our port
    speaks HTTP/2 only: an HTTP/1.1 GET must fail, or the gateway would send it OpenAI HTTP."""
    host, port = fleet.replicas[0].address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=5)
    with pytest.raises(http.client.HTTPException):
        try:
            conn.request("GET", "/health")
            conn.getresponse()
        finally:
            conn.close()


def test_chat_plain_and_streamed_give_the_same_greedy_text(fleet):
    plain = chat(fleet, max_tokens=12, temperature=0, ignore_eos=True)
    (choice,) = plain["choices"]
    assert choice["finish_reason"] == "length" and plain["usage"]["completion_tokens"] == 12
    events = fleet.stream("/v1/chat/completions", {"model": fleet.model, "messages": MESSAGES, "max_tokens": 12,
                                                   "temperature": 0, "ignore_eos": True, "stream_options": {"include_usage": True}})
    assert stream_text(events) == choice["message"]["content"]
    assert finish_reasons(events) == ["length"]
    assert events[-1]["usage"]["completion_tokens"] == 12


def test_completions_plain_and_streamed(fleet):
    body = {"model": fleet.model, "prompt": "once upon", "max_tokens": 10, "temperature": 0,
            "ignore_eos": True}
    status, plain = fleet.post("/v1/completions", body)
    assert status == 200, plain
    assert plain["choices"][0]["finish_reason"] == "length" and plain["usage"]["completion_tokens"] == 10
    events = fleet.stream("/v1/completions", body)
    assert stream_text(events) == plain["choices"][0]["text"] and finish_reasons(events) == ["length"]


def test_greedy_tokens_through_smg_equal_our_own_api(fleet):
    """The same conversation through SMG (which renders the chat template itself) and through
    llmsvc.v1 on one replica (which renders it in the server): the same greedy token ids."""
    got = chat(fleet, max_tokens=16, temperature=0, logprobs=True, ignore_eos=True)["choices"][0]
    smg_ids = token_ids(got)
    with grpc.insecure_channel(fleet.replicas[1].address) as ch:
        req = v1.GenerateRequest(chat=v1.ChatPrompt(messages=[v1.ChatMessage(**m) for m in MESSAGES]),
                                 sampling=v1.SamplingParams(temperature=0.0),
                                 stopping=v1.StoppingCriteria(max_tokens=16, ignore_eos=True))
        (ours,) = list(v1_grpc.LlmServiceStub(ch).Generate(req, timeout=60))
    assert len(smg_ids) == 16 and smg_ids == list(ours.token_ids)
    assert got["message"]["content"] == ours.text


def test_response_format_json_schema_holds_the_output(fleet):
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "n": {"enum": [1, 2, 3]}},
              "required": ["answer", "n"], "additionalProperties": False}
    got = chat(fleet, max_tokens=60, temperature=0,
               response_format={"type": "json_schema", "json_schema": {"name": "reply", "schema": schema}})
    choice = got["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    jsonschema.validate(json.loads(choice["message"]["content"]), schema)


def test_regex_holds_the_output(fleet):
    # SMG takes a regex as the top-level `regex` extension (its response_format knows only
    # text, json_object and json_schema)
    for kw in ({}, {"stream": True}):
        body = {"model": fleet.model, "messages": MESSAGES, "max_tokens": 20, "temperature": 0,
                "regex": "(yes|no)-[0-9]{3}"}
        if kw:
            events = fleet.stream("/v1/chat/completions", body)
            text, reasons = stream_text(events), finish_reasons(events)
        else:
            c = chat(fleet, **{k: v for k, v in body.items() if k not in ("model", "messages")})["choices"][0]
            text, reasons = c["message"]["content"], [c["finish_reason"]]
        assert re.fullmatch("(yes|no)-[0-9]{3}", text) and reasons == ["stop"], (text, reasons)


def test_n_choices_each_indexed_and_seeded(fleet):
    got = chat(fleet, max_tokens=6, temperature=1.0, n=3, seed=7, ignore_eos=True)
    assert [c["index"] for c in got["choices"]] == [0, 1, 2]
    assert got["usage"]["completion_tokens"] == 18
    again = chat(fleet, max_tokens=6, temperature=1.0, n=3, seed=7, ignore_eos=True)
    assert [c["message"]["content"] for c in again["choices"]] == [c["message"]["content"] for c in got["choices"]]
    events = fleet.stream("/v1/chat/completions", {"model": fleet.model, "messages": MESSAGES, "max_tokens": 6,
                                                   "temperature": 1.0, "n": 3, "seed": 7, "ignore_eos": True})
    assert [stream_text(events, i) for i in range(3)] == [c["message"]["content"] for c in got["choices"]]


def test_stop_string_ends_the_output_before_it(fleet):
    full = chat(fleet, max_tokens=16, temperature=0, ignore_eos=True)["choices"][0]["message"]["content"]
    # a stop string from the middle of the greedy output, where it first occurs
    stop = full[6:9]
    got = chat(fleet, max_tokens=16, temperature=0, ignore_eos=True, stop=[stop])["choices"][0]
    assert got["finish_reason"] == "stop" and got.get("matched_stop") == stop
    assert got["message"]["content"] == full[:full.index(stop)]


def test_logprobs_of_every_token_with_alternatives(fleet):
    got = chat(fleet, max_tokens=5, temperature=0, ignore_eos=True, logprobs=True, top_logprobs=3)
    content = got["choices"][0]["logprobs"]["content"]
    assert len(content) == 5
    for tok in content:
        tops = tok["top_logprobs"]
        assert len(tops) == 3 and tops[0]["logprob"] >= tops[1]["logprob"] >= tops[2]["logprob"]
        assert tok["logprob"] == pytest.approx(tops[0]["logprob"])  # greedy: the best one
        assert tok["logprob"] <= 0


def test_client_disconnect_aborts_and_every_kv_block_comes_back(fleet):
    aborted = 'llmsvc_request_success_total{finish_reason="abort"}'
    before = sum(r.metrics().get(aborted, 0.0) for r in fleet.replicas)
    body = {"model": fleet.model, "messages": MESSAGES, "max_tokens": 900, "ignore_eos": True, "temperature": 0}
    with open_stream(fleet.url, "/v1/chat/completions", body) as resp:
        assert resp.status == 200
        events = sse_events(resp)
        got = [next(events) for _ in range(4)]  # the request runs on a replica; then the client goes
        assert stream_text(got)
    deadline = time.monotonic() + 60
    while True:
        infos = []
        for r in fleet.replicas:
            with grpc.insecure_channel(r.address) as ch:
                infos.append(v1_grpc.LlmServiceStub(ch).GetServerInfo(v1.GetServerInfoRequest(), timeout=5))
        done = all(i.num_running == i.num_waiting == 0 and i.num_free_kv_blocks == i.num_kv_blocks for i in infos)
        if done and sum(r.metrics().get(aborted, 0.0) for r in fleet.replicas) == before + 1:
            break
        assert time.monotonic() < deadline, f"blocks not back / no abort: {infos}"
        time.sleep(0.2)


def test_shared_prefixes_land_on_the_replica_that_caches_them(fleet):
    """Two long system prompts, each followed by different questions, one request at a time:
    every request of a prefix goes where its first one went, and there it hits the cache."""
    hits = "llmsvc_prefix_cache_hits_total"
    fleet.post("/flush_cache", {})
    prefixes = [("You are a careful assistant. " * 12), ("Answer in riddles, always. " * 12)]
    homes: dict[int, int] = {}
    # not alternating, so that taking turns (round_robin) would move each prefix
    for rnd, p in enumerate([0, 0, 1, 1, 0, 1, 1, 0]):
        prefix = prefixes[p]
        before, hits_before = served(fleet), [r.metrics().get(hits, 0.0) for r in fleet.replicas]
        chat(fleet, max_tokens=2, temperature=0,
             messages=[{"role": "system", "content": prefix}, {"role": "user", "content": f"question {rnd}"}])
        after = served(fleet)
        (where,) = [i for i in range(2) if after[i] > before[i]]
        first = p not in homes
        assert homes.setdefault(p, where) == where, f"prefix {p} moved from replica {homes[p]} to {where}"
        if not first:  # the prefix's full 16-token blocks (but the last, maybe) came from that replica's cache
            full_blocks = len(ascii_tokenizer().encode(prefix)) // 16
            assert fleet.replicas[where].metrics()[hits] - hits_before[where] >= 16 * (full_blocks - 1)


def test_bench_chat_client_through_smg(fleet):
    """`llmsvc bench --openai`'s client through the real gateway: every request completes with
    exactly the tokens asked for (ignore_eos and min_tokens pass through SMG), usage counted."""
    from llmsvc.bench.openai_chat import run_chat, served_model

    assert served_model(fleet.url) == fleet.model
    texts = ["tell me a story", "what is a cat", "count to ten"]
    recs, wall = run_chat(fleet.url, fleet.model, texts, [10, 11, 12], 8, [0.0, 0.0, 0.1])
    assert [r.error for r in recs] == [None] * 3
    assert [r.output_len for r in recs] == [8, 8, 8]
    assert all(0 < r.ttft <= r.end - r.start <= wall for r in recs)


@pytest.mark.e2e
@pytest.mark.slow  # a fleet of its own; the tiny model's greedy test above runs in every `make test`
def test_default_model_greedy_text_through_smg_equals_our_own_api(default_model_dir):
    """SmolLM2-135M-Instruct behind SMG: the gateway's chat template and detokenizer, our
    server's, the same greedy answer."""
    question = [{"role": "user", "content": "What is the capital of France?"}]
    with smg_fleet(default_model_dir, replicas=1) as f:
        status, got = f.post("/v1/chat/completions", {"model": f.model, "messages": question, "max_tokens": 24,
                                                      "temperature": 0})
        assert status == 200, got
        with grpc.insecure_channel(f.replicas[0].address) as ch:
            req = v1.GenerateRequest(chat=v1.ChatPrompt(messages=[v1.ChatMessage(**m) for m in question]),
                                     sampling=v1.SamplingParams(temperature=0.0),
                                     stopping=v1.StoppingCriteria(max_tokens=24))
            (ours,) = list(v1_grpc.LlmServiceStub(ch).Generate(req, timeout=120))
    choice = got["choices"][0]
    assert choice["message"]["content"] == ours.text and "Paris" in ours.text
    assert got["usage"]["completion_tokens"] == ours.num_output_tokens
