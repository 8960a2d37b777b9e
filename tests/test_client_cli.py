"""`llmsvc generate`, `llmsvc health` and the reflection-only client, against the scripted server."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fake_llm_server import FakeServer
from llmsvc.__main__ import main as llmsvc_main

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def server():
    with FakeServer() as srv:
        yield srv


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = llmsvc_main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_generate_prints_completion_and_sends_flags(server, capsys):
    rc, out, _ = run(capsys, "generate", "hello world", "--server", server.target, "--max-tokens", "5",
                     "--temperature", "0.5", "--top-p", "0.9", "--top-k", "7", "--seed", "11",
                     "--stop", "\n\n", "--stop", "END", "--ignore-eos", "--cache-salt", "tenant-a",
                     "--allowed-token-id", "3", "--allowed-token-id", "9", "--bad-word", "darn")
    assert rc == 0 and out == "hello\n"
    req = server.service.requests[-1]
    assert not req.stream and req.stopping.max_tokens == 5 and req.stopping.ignore_eos
    assert list(req.stopping.stop) == ["\n\n", "END"]
    assert req.sampling.temperature == 0.5 and req.sampling.top_k == 7 and req.sampling.seed == 11
    assert abs(req.sampling.top_p - 0.9) < 1e-6
    assert not req.sampling.HasField("min_p") and not req.output.HasField("logprobs")  # unset stays unset
    assert req.cache_salt == "tenant-a" and list(req.sampling.allowed_token_ids) == [3, 9]
    assert list(req.sampling.bad_words) == ["darn"]


def test_generate_stream_prints_tokens(server, capsys):
    rc, out, _ = run(capsys, "generate", "streamed text", "--server", server.target, "--stream")
    assert rc == 0 and out == "streamed text\n" and server.service.requests[-1].stream
    assert not server.service.requests[-1].output.HasField("stream_interval")
    rc, out, _ = run(capsys, "generate", "streamed text", "--server", server.target, "--stream",
                     "--stream-interval", "4")
    assert rc == 0 and out == "streamed text\n" and server.service.requests[-1].output.stream_interval == 4


def test_a_stream_failing_midway_ends_its_partial_line(server, capsys):
    # "wait" streams "x" then hangs: the deadline ends the call after partial text
    rc, out, err = run(capsys, "generate", "wait", "--server", server.target, "--stream", "--timeout", "0.5")
    assert rc == 1 and out == "x\n" and "DEADLINE_EXCEEDED" in err


def test_generate_json_outputs(server, capsys):
    rc, out, _ = run(capsys, "generate", "json", "--server", server.target, "--json", "--request-id", "j1")
    doc = json.loads(out)
    assert rc == 0 and doc["request_id"] == "j1"
    assert doc["outputs"][0]["text"] == "json" and doc["outputs"][0]["finish_reason"] == "stop"
    assert doc["outputs"][0]["token_ids"] == [ord(c) for c in "json"]

    rc, out, _ = run(capsys, "generate", "lines", "--server", server.target, "--json", "--stream")
    lines = [json.loads(line) for line in out.splitlines()]
    assert rc == 0 and "".join(m.get("text", "") for m in lines) == "lines"
    assert "prompt" in lines[0] and "finish" in lines[-1]


def test_generate_chat(server, capsys):
    rc, _, _ = run(capsys, "generate", "hi there", "--server", server.target, "--chat", "--system", "be brief")
    msgs = server.service.requests[-1].chat.messages
    assert rc == 0 and [(m.role, m.content) for m in msgs] == [("system", "be brief"), ("user", "hi there")]


def test_generate_chat_tools_and_template_kwargs(server, capsys, tmp_path):
    tools = tmp_path / "tools.json"
    tools.write_text('[{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]')
    rc, _, _ = run(capsys, "generate", "weather?", "--server", server.target, "--chat", "--tools", str(tools),
                   "--chat-template-kwargs", '{"enable_thinking": false}')
    chat = server.service.requests[-1].chat
    assert rc == 0 and chat.tools[0]["function"]["name"] == "weather"
    assert chat.chat_template_kwargs["enable_thinking"] is False
    for argv, why in ((["--tools", str(tools)], "--tools needs --chat"),
                      (["--chat", "--chat-template-kwargs", "[1]"], "--chat-template-kwargs: must be a JSON object"),
                      (["--chat", "--chat-template-kwargs", "{oops"], "--chat-template-kwargs: not JSON")):
        assert refused(capsys, "generate", "x", "--server", server.target, *argv).startswith(
            f"llmsvc generate: error: {why}")  # a usage error: exit 2, as argparse's own
    ca = tmp_path / "ca.pem"
    ca.write_text("unused\n")
    for command, operands in (("generate", ["x"]), ("health", []), ("admin", ["drain"])):
        line = refused(capsys, command, "--server", server.target, "--tls-ca", str(ca), "--tls-cert", str(ca),
                       *operands)
        assert line == f"llmsvc {command}: error: --tls-cert and --tls-key go together, and need --tls-ca"


def test_generate_error_exit_code_and_message(server, capsys):
    rc, out, err = run(capsys, "generate", "error:INVALID_ARGUMENT", "--server", server.target)
    assert rc == 1 and out == ""
    assert "INVALID_ARGUMENT" in err and "sampling.temperature" in err
    rc, _, err = run(capsys, "generate", "error:UNAVAILABLE", "--server", server.target, "--stream")
    assert rc == 1 and "UNAVAILABLE" in err


def test_health_cli_exit_codes(server, capsys):
    assert run(capsys, "health", "--server", server.target)[:2] == (0, "SERVING\n")
    rc, out, _ = run(capsys, "health", "--server", server.target, "--service", "llmsvc.v1.LlmService")
    assert (rc, out) == (1, "NOT_SERVING\n")
    rc, _, err = run(capsys, "health", "--server", server.target, "--service", "nope")
    assert rc == 2 and "NOT_FOUND" in err


def test_health_console_script(server):
    """What a container healthcheck runs: a fresh process, exit status only."""
    r = subprocess.run([sys.executable, "-m", "llmsvc", "health", "--server", server.target, "--timeout", "10"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([sys.executable, "-m", "llmsvc", "health", "--server", "127.0.0.1:1", "--timeout", "2"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and ("UNAVAILABLE" in r.stderr or "DEADLINE_EXCEEDED" in r.stderr)


def test_reflection_only_client_streams_without_proto_file(server):
    """A client with no .proto and no generated stubs learns LlmService by reflection and streams."""
    code = textwrap.dedent(f"""
        import json, sys, grpc
        from llmsvc.client.reflection import ReflectionClient
        with grpc.insecure_channel({server.target!r}) as channel:
            rc = ReflectionClient(channel)
            services = rc.services()
            gen = rc.method("llmsvc.v1.LlmService/Generate")
            msgs = [rc.to_dict(m) for m in rc.call("llmsvc.v1.LlmService/Generate",
                    {{"text": "reflected!", "stream": True, "stopping": {{"max_tokens": 9}}}}, timeout=10)]
            info = rc.to_dict(rc.call("llmsvc.v1.LlmService.GetServerInfo", {{}}, timeout=10))
        assert not any(m.startswith("llmsvc.v1") or m == "llmsvc.client.client" for m in sys.modules), \\
            "generated stubs were imported"
        print(json.dumps({{"services": services, "server_streaming": gen.server_streaming,
                           "msgs": msgs, "info": info}}))
    """)
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(r.stdout)
    assert "llmsvc.v1.LlmService" in doc["services"] and doc["server_streaming"]
    assert "".join(m.get("text", "") for m in doc["msgs"]) == "reflected"
    assert doc["msgs"][-1]["finish"]["reason"] == "REASON_LENGTH"
    assert doc["info"]["api_version"] == "llmsvc.v1"


def test_error_lines_state_each_violation_once(capsys):
    from types import SimpleNamespace

    from llmsvc.client.cli_common import print_error

    class Err(Exception):
        field_violations = [("sampling.temperature", "must be >= 0, got -1"), ("stopping.stop[0]", "must not be empty")]

    print_error("llmsvc generate", Err("INVALID_ARGUMENT: sampling.temperature: must be >= 0, got -1"))
    lines = capsys.readouterr().err.splitlines()
    assert lines == ["llmsvc generate: INVALID_ARGUMENT: sampling.temperature: must be >= 0, got -1",
                     "  stopping.stop[0]: must not be empty"]
    print_error("llmsvc generate", SimpleNamespace())  # no violations: the one line
    assert len(capsys.readouterr().err.splitlines()) == 1

    class NotFound(Exception):  # a message that is the violation's description alone
        field_violations = [("lora_name", "no LoRA adapter named 'foo'; served: a")]
    print_error("llmsvc generate", NotFound("NOT_FOUND: no LoRA adapter named 'foo'; served: a"))
    assert len(capsys.readouterr().err.splitlines()) == 1


def refused(capsys, *argv: str) -> str:
    """The last stderr line of a command argparse refuses (exit 2, before any call)."""
    with pytest.raises(SystemExit) as exc:
        llmsvc_main(list(argv))
    err = capsys.readouterr().err
    assert exc.value.code == 2, err
    return err.splitlines()[-1]


@pytest.mark.parametrize("command", ["generate", "health", "admin"])
def test_missing_tls_ca_names_the_flag_and_path(capsys, tmp_path, command):
    missing = tmp_path / "ca.pem"
    operands = {"generate": ["hi"], "admin": ["drain"]}.get(command, [])
    line = refused(capsys, command, "--tls-ca", str(missing), *operands)
    assert line == f"llmsvc {command}: error: argument --tls-ca: cannot read {missing}: No such file or directory"


def test_missing_mtls_and_tools_files_name_the_flag_and_path(capsys, tmp_path):
    ca = tmp_path / "ca.pem"
    ca.write_text("unused\n")
    cert, key = tmp_path / "client.pem", tmp_path / "client.key"
    line = refused(capsys, "generate", "hi", "--tls-ca", str(ca), "--tls-cert", str(cert), "--tls-key", str(key))
    assert line == f"llmsvc generate: error: argument --tls-cert: cannot read {cert}: No such file or directory"
    cert.write_text("present\n")
    line = refused(capsys, "generate", "hi", "--tls-ca", str(ca), "--tls-cert", str(cert), "--tls-key", str(key))
    assert line == f"llmsvc generate: error: argument --tls-key: cannot read {key}: No such file or directory"
    line = refused(capsys, "generate", "hi", "--chat", "--tools", str(tmp_path))
    assert line == f"llmsvc generate: error: argument --tools: cannot read {tmp_path}: Is a directory"


@pytest.mark.parametrize("argv, message", [
    (["--seed", "-1"], "argument --seed: must be >= 0, got -1"),
    (["--seed", str(2**64)], f"argument --seed: must be <= {2**64 - 1}, got {2**64}"),
    (["--logprobs", "-1"], "argument --logprobs: must be >= 0, got -1"),
    (["--max-tokens", "-3"], "argument --max-tokens: must be >= 1, got -3"),
    (["--max-tokens", "0"], "argument --max-tokens: must be >= 1, got 0"),  # the field's own bound
    (["--max-tokens", str(2**32)], f"argument --max-tokens: must be <= {2**32 - 1}, got {2**32}"),
    (["--time-limit-ms", "-1"], "argument --time-limit-ms: must be >= 0, got -1"),
    (["--top-k", str(2**31)], f"argument --top-k: must be <= {2**31 - 1}, got {2**31}"),
    (["--stop-token-id", "-1"], "argument --stop-token-id: must be >= 0, got -1"),
    (["--n", "two"], "argument --n: invalid integer: 'two'"),
    (["--stream", "--stream-interval", "0"], "argument --stream-interval: must be >= 1, got 0"),
    (["--timeout", "-1"], "argument --timeout: must be a finite number > 0, got -1"),
    (["--timeout", "nan"], "argument --timeout: must be a finite number > 0, got nan"),
    (["--timeout", "0"], "argument --timeout: must be a finite number > 0, got 0"),
    (["--max-retries", "5"], "argument --max-retries: must be <= 4, got 5"),
])
def test_generate_refuses_number_flags_that_can_never_be_valid(server, capsys, argv, message):
    line = refused(capsys, "generate", "hi", "--server", server.target, *argv)
    assert line == f"llmsvc generate: error: {message}"


def test_number_flags_pass_the_whole_range_of_their_proto_field(server, capsys):
    """Only what the wire cannot carry is refused: limits that depend on the model (a negative
    top_k, a large logprobs) are the server's to judge."""
    rc, _, err = run(capsys, "generate", "hi", "--server", server.target, "--seed", str(2**64 - 1),
                     "--top-k", "-1", "--logprobs", "0", "--time-limit-ms", "0", "--timeout", "30")
    req = server.service.requests[-1]
    assert rc == 0, err
    assert req.sampling.seed == 2**64 - 1 and req.sampling.top_k == -1 and req.output.logprobs == 0
    assert refused(capsys, "health", "--timeout", "inf") == \
        "llmsvc health: error: argument --timeout: must be a finite number > 0, got inf"


def test_top_level_help_names_every_admin_action(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # narrower, argparse may break a line inside "flush-cache"
    with pytest.raises(SystemExit):
        llmsvc_main(["admin", "--help"])
    actions = re.search(r"\{([a-z,-]+)\}", capsys.readouterr().out).group(1).split(",")
    assert {"drain", "flush-cache", "load-lora", "unload-lora"} <= set(actions)
    with pytest.raises(SystemExit):
        llmsvc_main(["--help"])
    (line,) = [l for l in capsys.readouterr().out.splitlines() if l.split()[:1] == ["admin"]]
    assert all(a in line for a in actions), line


def test_the_default_server_follows_the_servers_port(monkeypatch):
    # the container healthcheck runs with the server's environment: LLMSVC_PORT moves both
    from llmsvc.client.cli_common import DEFAULT_SERVER, default_server
    monkeypatch.delenv("LLMSVC_SERVER", raising=False)
    monkeypatch.delenv("LLMSVC_PORT", raising=False)
    assert default_server() == DEFAULT_SERVER
    monkeypatch.setenv("LLMSVC_PORT", "50099")
    assert default_server() == "127.0.0.1:50099"
    monkeypatch.setenv("LLMSVC_SERVER", "elsewhere:1")
    assert default_server() == "elsewhere:1"
