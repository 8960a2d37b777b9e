"""LLM(executor="multiproc") from a plain script: spawned workers re-run the main script, so an
unguarded script must fail saying exactly what to add, and the guarded one must work."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.server_harness import make_tiny_served_model_dir

REPO = Path(__file__).resolve().parents[1]
BODY = '''from llmsvc import LLM, SamplingParams
{indent}llm = LLM(model={model!r}, executor="multiproc", device="cpu", max_model_len=64)
{indent}out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
{indent}print("tokens", out[0].outputs[0].token_ids)
{indent}llm.shutdown()
'''


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_served_model_dir(tmp_path_factory.mktemp("mp-script"))


def run_script(tmp_path, text: str) -> subprocess.CompletedProcess:
    script = tmp_path / "script.py"
    script.write_text(text)
    return subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})


def test_unguarded_script_says_what_to_add(tmp_path, model_dir):
    r = run_script(tmp_path, BODY.format(indent="", model=model_dir))
    assert r.returncode != 0
    assert 'if __name__ == "__main__":' in r.stderr
    assert "could not start" in r.stderr.splitlines()[-1]  # the error the script ends with


def test_guarded_script_runs(tmp_path, model_dir):
    text = BODY.format(indent="    ", model=model_dir).replace(
        "from llmsvc import LLM, SamplingParams\n", "from llmsvc import LLM, SamplingParams\nif __name__ == \"__main__\":\n")
    r = run_script(tmp_path, text)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.startswith("tokens [") and len(r.stdout.split(",")) == 4
