"""`make serve` and `make test` as first commands on a fresh machine (dry runs of the Makefile):
serving installs only the runtime, never npm nor the test extra; tests add the test extra, which
brings the Buf CLI from PyPI (buf-bin) for tests/test_proto.py."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = Path(__file__).resolve().parents[1]


def dry_run(tmp_path, target: str) -> str:
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    for name in ("Makefile", "pyproject.toml"):  # a checkout without .venv: every step is due
        shutil.copy(ROOT / name, tmp_path / name)
    r = subprocess.run(["make", "-n", target], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_make_serve_installs_the_runtime_only(tmp_path):
    out = dry_run(tmp_path, "serve")
    assert "torch==2.13.0" in out and "pip install -q -e '.[server]'" in out and "llmsvc serve" in out
    assert "npm" not in out and "[test]" not in out


def test_torch_is_the_cpu_build_unless_asked_otherwise(tmp_path):
    # PyPI's torch for Linux x86_64 is the CUDA build (and pins a triton the test extra's clashes with)
    out = dry_run(tmp_path, "serve")
    assert "pip install -q torch==2.13.0 --no-deps --extra-index-url https://download.pytorch.org/whl/cpu" in out
    # torch's own dependencies come with the project's install (pip resolves an installed torch's)
    assert out.index("torch==2.13.0") < out.index("-e '.[server]'")
    r = subprocess.run(["make", "-n", "serve", "TORCH_INDEX_URL="], cwd=tmp_path, capture_output=True, text=True,
                       timeout=60)
    assert "pip install -q torch==2.13.0\n" in r.stdout and "extra-index-url" not in r.stdout
    # the CPU torch brings no triton: the test extra adds the interpreter's; a CUDA torch has its own
    assert "-e '.[test,triton-cpu]'" in dry_run(tmp_path, "test")
    r = subprocess.run(["make", "-n", "test", "TORCH_INDEX_URL="], cwd=tmp_path, capture_output=True, text=True,
                       timeout=60)
    assert "-e '.[test]'" in r.stdout and "triton-cpu" not in r.stdout


def test_make_test_adds_the_test_extra(tmp_path):
    out = dry_run(tmp_path, "test")
    assert "torch==2.13.0" in out and "-e '.[test," in out and "pytest" in out
    assert "npm" not in out


def test_buf_comes_from_the_test_extra_into_the_venv():
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    assert any(dep.split(";")[0].strip().startswith("buf-bin") for dep in extra)
    runtime = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert not any(dep.startswith(("buf-bin", "pytest")) for dep in runtime)
    assert (Path(sys.executable).parent / "buf").exists(), "install the test extra: pip install -e '.[test]'"
