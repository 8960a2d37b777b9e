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


GUARD = 'from llmsvc import LLM, SamplingParams\nif __name__ == "__main__":\n'


@pytest.mark.parametrize("ending", ["", "    raise RuntimeError('the script fails after generate')\n"])
def test_a_script_that_never_shuts_the_llm_down_still_exits(tmp_path, model_dir, ending):
    # multiprocessing's exit hook SIGTERMs its daemon workers and joins them; the workers ignore
    # SIGTERM, so without the executor's own exit hook the script hung after its last line
    text = BODY.format(indent="    ", model=model_dir).replace("from llmsvc import LLM, SamplingParams\n", GUARD)
    text = text.replace("    llm.shutdown()\n", ending)
    script = tmp_path / "script.py"
    script.write_text(text)
    r = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == (1 if ending else 0), r.stderr[-3000:]
    assert r.stdout.startswith("tokens [")


def test_generate_interrupted_mid_step_leaves_the_llm_usable(tmp_path, model_dir):
    # Ctrl-C while rank 0 computes a step: its reply comes after the interrupt, and the next
    # step read it as its own (the scheduler then failed an assertion on every later generate)
    text = GUARD + f'''    params = SamplingParams(max_tokens=6, temperature=0.0)
    llm = LLM(model={model_dir!r}, executor="multiproc", device="cpu", max_model_len=64)
    expected = llm.generate([[5, 6, 7], [8, 9]], params, use_tqdm=False)
    executor = llm.llm_engine.core_client.core.executor
    reply, calls = executor._reply, []
    def interrupted(method, timeout=None):
        calls.append(method)
        if len(calls) == 3:  # the third step, with both requests running
            raise KeyboardInterrupt
        return reply(method, timeout)
    executor._reply = interrupted
    try:
        llm.generate([[5, 6, 7], [8, 9]], params, use_tqdm=False)
    except KeyboardInterrupt:
        print("interrupted")
    executor._reply = reply
    again = llm.generate([[5, 6, 7], [8, 9]], params, use_tqdm=False)
    print("same", [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in expected])
    llm.shutdown()
'''
    script = tmp_path / "script.py"
    script.write_text(text)
    r = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=180,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["interrupted", "same", "True"]
