"""Structured logs: text/json formats, request ids from the ContextVar in the request path."""
from __future__ import annotations

import io
import json
import logging
import time

import pytest

from llmsvc.server.logging_setup import (JsonFormatter, make_handler, request_id_var, request_labels_var,
                                         setup_logging)
from llmsvc.server.vllm_engine.proto import vllm_engine_pb2 as vpb
from llmsvc.server.vllm_engine.proto import vllm_engine_pb2_grpc as vgrpc
from llmsvc.v1 import llmsvc_pb2 as pb
from tests.server_harness import ServerThread, fake_engine_factory


@pytest.fixture()
def restore_root():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for h in list(root.handlers):
        root.removeHandler(h)
    for h in handlers:
        root.addHandler(h)
    root.setLevel(level)


def test_json_lines_carry_request_id_and_extra(restore_root):
    buf = io.StringIO()
    setup_logging("DEBUG", "json", stream=buf)
    log = logging.getLogger("llmsvc.test")
    log.info("plain %d", 1)
    token = request_id_var.set("req-42")
    try:
        log.warning("in a request", extra={"prompt_tokens": 7, "obj": object()})
    finally:
        request_id_var.reset(token)
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        log.exception("failed")
    lines = buf.getvalue().splitlines()
    assert len(lines) == 3
    a, b, c = (json.loads(x) for x in lines)
    assert a["msg"] == "plain 1" and a["level"] == "INFO" and a["logger"] == "llmsvc.test" and "request_id" not in a
    assert a["ts"].endswith("Z") and "T" in a["ts"]
    assert b["request_id"] == "req-42" and b["prompt_tokens"] == 7 and b["obj"].startswith("<object")
    assert c["level"] == "ERROR" and "RuntimeError: boom" in c["exc"]


def test_text_format_tags_request_id(restore_root):
    buf = io.StringIO()
    setup_logging("INFO", "text", stream=buf)
    log = logging.getLogger("llmsvc.test")
    log.debug("hidden")
    log.info("no id")
    token = request_id_var.set("abc")
    log.info("with id")
    labels = request_labels_var.set({"tenant": "a\nb"})
    log.info("with labels")
    request_labels_var.reset(labels)
    request_id_var.reset(token)
    lines = buf.getvalue().splitlines()
    assert len(lines) == 3 and "[req=" not in lines[0] and "llmsvc.test [req=abc]: with id" in lines[1]
    assert 'llmsvc.test [req=abc labels={"tenant": "a\\nb"}]: with labels' in lines[2]  # a label cannot break a line
    with pytest.raises(ValueError):
        make_handler("xml")


def test_request_path_log_lines_have_the_request_id():
    buf = io.StringIO()
    handler = make_handler("json", buf)
    server_log = logging.getLogger("llmsvc.server")
    old = server_log.level
    server_log.addHandler(handler)
    server_log.setLevel(logging.DEBUG)
    s = ServerThread(fake_engine_factory())
    try:
        list(s.stub.Generate(pb.GenerateRequest(text="hi", request_id="log-me-1", labels={"tenant": "acme"},
                                                stopping=pb.StoppingCriteria(max_tokens=2))))
        list(s.stub.Generate(pb.GenerateRequest(text="hi", stopping=pb.StoppingCriteria(max_tokens=2)),
                             metadata=(("x-request-id", "from-metadata"),)))
    finally:
        s.stop()
        server_log.removeHandler(handler)
        server_log.setLevel(old)
    records = [json.loads(x) for x in buf.getvalue().splitlines()]
    mine = [r for r in records if r.get("request_id") == "log-me-1"]
    assert any("admitted" in r["msg"] for r in mine) and any("finished: length" in r["msg"] for r in mine)
    assert all(r["labels"] == {"tenant": "acme"} for r in mine)  # GenerateRequest.labels on every line
    assert all("labels" not in r for r in records if r.get("request_id") == "from-metadata")
    assert any(r.get("request_id") == "from-metadata" and "finished" in r["msg"] for r in records)
    lifecycle = [r for r in records if "listening on" in r["msg"] or "draining" in r["msg"]]
    assert lifecycle and all("request_id" not in r for r in lifecycle)  # not inside a request


def test_disable_log_requests_drops_the_per_request_lines(caplog):
    with caplog.at_level(logging.INFO, logger="llmsvc.server"):
        with ServerThread(fake_engine_factory(), log_requests=False) as s:
            for rid in ("quiet-1", "quiet-2"):
                list(s.stub.Generate(pb.GenerateRequest(text="hi", request_id=rid,
                                                        stopping=pb.StoppingCriteria(max_tokens=2))))
            cancelled = s.stub.Generate(pb.GenerateRequest(text="hi", request_id="quiet-3", stream=True,
                                                           stopping=pb.StoppingCriteria(max_tokens=200)))
            next(cancelled)
            cancelled.cancel()
    msgs = [r.getMessage() for r in caplog.records]
    assert any("listening on" in m for m in msgs)  # the server's own lines stay
    assert not [m for m in msgs if "quiet-" in m and ("finished" in m or "cancelled" in m)]


def test_json_formatter_without_filter_reads_contextvar():
    rec = logging.LogRecord("x", logging.INFO, __file__, 1, "m", None, None)
    token = request_id_var.set("ctx")
    try:
        assert json.loads(JsonFormatter().format(rec))["request_id"] == "ctx"
    finally:
        request_id_var.reset(token)


@pytest.mark.parametrize("log_requests", [True, False])
def test_the_vllm_door_leaves_the_same_per_request_lines(caplog, log_requests):
    """A gateway's requests arrive through vLLM's engine door: each ends with the same one line
    as llmsvc.v1's (finished with its reasons and counts, or cancelled), unless turned off."""
    with caplog.at_level(logging.INFO, logger="llmsvc.server"):
        with ServerThread(fake_engine_factory(), log_requests=log_requests) as s:
            door = vgrpc.VllmEngineStub(s.channel)
            list(door.Generate(vpb.GenerateRequest(request_id="door-1", tokenized=vpb.TokenizedInput(
                input_ids=[97] * 5), sampling_params=vpb.SamplingParams(max_tokens=2))))
            call = door.Generate(vpb.GenerateRequest(request_id="door-2", stream=True, tokenized=vpb.TokenizedInput(
                input_ids=[97] * 5), sampling_params=vpb.SamplingParams(max_tokens=200, ignore_eos=True)))
            next(call)
            call.cancel()
            time.sleep(0.5)  # the server sees the cancel
    msgs = [r.getMessage() for r in caplog.records]
    finished = [m for m in msgs if "request door-1 finished: length; 5 prompt tokens, 2 generated" in m]
    cancelled = [m for m in msgs if "request door-2 cancelled" in m]
    assert (len(finished), len(cancelled)) == ((1, 1) if log_requests else (0, 0)), msgs


def test_a_cancel_while_draining_does_not_blame_the_client(caplog):
    # the stop at the end of the shutdown grace cancels the calls still open: the line said
    # "cancelled by the client or its deadline" for them
    from llmsvc.server.servicer import log_cancelled
    with caplog.at_level(logging.INFO, logger="llmsvc.server"):
        log_cancelled("r1")
        log_cancelled("r2", draining=True)
    msgs = [r.getMessage() for r in caplog.records]
    assert msgs == ["request r1 cancelled by the client or its deadline",
                    "request r2 cancelled by the client, its deadline or the end of the shutdown grace"]
