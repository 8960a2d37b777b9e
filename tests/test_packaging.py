"""`kernels` and `executors` are this repository's packages, even though Hugging Face
publishes an unrelated PyPI package called `kernels` that transformers probes for.

How transformers probes (5.x, transformers.utils.import_utils.is_kernels_available):
find_spec("kernels") finds OUR package, then its version is looked up in the metadata of
the distribution that provides the top-level name `kernels` -- that is `llmsvc`, so the
"kernels version" is llmsvc's version (0.1.0), outside the range transformers accepts
for the hub package, and the hub-kernels integration stays off. Should llmsvc's version
ever fall in that range, transformers would try `from kernels import get_kernel, ...`
from our package; test_transformers_does_not_take_our_kernels_for_the_hub_package
then fails and says so."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(code: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    # a neutral cwd: the packages must resolve to the repo through the installed project,
    # not because the repo root happens to be the current directory
    out = subprocess.run([sys.executable, "-c", code], cwd="/", env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_kernels_and_executors_resolve_to_this_repo():
    out = _run("import importlib.util as u\n"
               "for n in ('kernels', 'executors', 'llmsvc'):\n"
               "    print(list(u.find_spec(n).submodule_search_locations)[0])")
    for line, name in zip(out.split(), ("kernels", "executors", "llmsvc")):
        assert os.path.realpath(line) == os.path.realpath(os.path.join(REPO, name)), line
    import executors
    import kernels
    assert os.path.realpath(kernels.__file__).startswith(os.path.realpath(REPO))
    assert os.path.realpath(executors.__file__).startswith(os.path.realpath(REPO))
    import kernels.ops
    assert callable(kernels.ops.paged_attention)


def test_transformers_does_not_take_our_kernels_for_the_hub_package():
    from transformers.utils import import_utils
    available = import_utils.is_kernels_available()
    assert available is False, (
        "transformers now believes our `kernels` package is Hugging Face's hub `kernels` "
        f"(detected version {import_utils._is_package_available('kernels', return_version=True)}); "
        "it will import hub functions (get_kernel, kernelize, ...) from it")


def test_transformers_imports_and_loads_a_model_with_our_kernels_on_the_path(tmp_path):
    from model_utils import make_tiny_model_dir
    d = make_tiny_model_dir(tmp_path, "llama")
    out = _run(
        "import kernels, kernels.ops, executors, torch, transformers\n"
        "from transformers import AutoModelForCausalLM\n"
        f"m = AutoModelForCausalLM.from_pretrained({d!r}, dtype=torch.float32)\n"
        "with torch.no_grad():\n"
        "    y = m(torch.tensor([[5, 6, 7]])).logits\n"
        "print(tuple(y.shape), bool(torch.isfinite(y).all()))\n"
        "print(kernels.__file__)\n")
    lines = out.strip().splitlines()
    assert lines[0] == "(1, 3, 320) True"
    assert os.path.realpath(lines[1]).startswith(os.path.realpath(REPO))


@pytest.mark.parametrize("mod", ["llmsvc.models.resolve", "llmsvc.models", "llmsvc.models.loader_names"])
def test_resolver_is_torch_free_at_import(mod):
    out = _run(f"import sys, {mod}; print('torch' in sys.modules, 'transformers' in sys.modules)")
    assert out.strip() == "False False"


def test_the_source_distribution_carries_the_proto(tmp_path):
    # clients in other languages compile protos/, and tests/test_proto.py reads it
    import shutil
    import tarfile
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout.decode()
    src = tmp_path / "src"
    for rel in filter(None, files.split("\0")):
        if os.path.isfile(os.path.join(REPO, rel)):
            os.makedirs(src / os.path.dirname(rel), exist_ok=True)
            shutil.copy(os.path.join(REPO, rel), src / rel)
    out = subprocess.run([sys.executable, "-c", "import sys; from setuptools import build_meta; "
                          "print(build_meta.build_sdist(sys.argv[1]))", str(tmp_path / "dist")],
                         cwd=src, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    with tarfile.open(tmp_path / "dist" / out.stdout.split()[-1]) as t:
        names = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    assert {"protos/llmsvc/v1/llmsvc.proto", "buf.yaml", "tests/test_proto.py"} <= names


def test_one_version_from_pyproject_everywhere():
    tomllib = pytest.importorskip("tomllib")
    import llmsvc
    from llmsvc.version import installed_version
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        declared = tomllib.load(f)["project"]["version"]
    out = subprocess.run([sys.executable, "-m", "llmsvc", "--version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == f"llmsvc {declared}"
    assert llmsvc.__version__ == installed_version() == declared  # GetServerInfo.version, the vLLM door's loads
