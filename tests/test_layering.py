"""The import direction of docs/design.md, checked on the source: imports only point down the layer list."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# top to bottom; a module may import its own layer and any layer below it
LAYERS = ["entry", "server", "client", "engine", "core", "structured", "executors", "worker", "models",
          "kernels", "shared"]
SHARED = {"llmsvc.config", "llmsvc.sampling_params", "llmsvc.wire", "llmsvc.outputs", "llmsvc.engine_request",
          "llmsvc.sampling_fields", "llmsvc.sampling_params_error", "llmsvc.structured_params"}
# the dependency-free declarations the client derives its flags from
CLIENT_SHARED = {"llmsvc.sampling_params", "llmsvc.sampling_params.SamplingParams", "llmsvc.sampling_fields",
                 "llmsvc.sampling_fields.declared", "llmsvc.sampling_params_error", "llmsvc.structured_params"}
TORCH_FREE = ["llmsvc.engine", "llmsvc.core", "llmsvc.client", "llmsvc.server", "executors", "llmsvc.v1",
              "llmsvc.structured"]


def layer_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] == "kernels":
        return "kernels"
    if parts[0] == "executors":
        return "executors"
    if parts[0] != "llmsvc":
        return None  # third party
    if module in SHARED or any(module.startswith(s + ".") for s in SHARED):
        return "shared"
    sub = parts[1] if len(parts) > 1 else ""
    return {"server": "server", "client": "client", "v1": "client", "engine": "engine", "core": "core",
            "structured": "structured", "worker": "worker", "models": "models"}.get(sub, "entry")


def source_modules():
    for top in ("llmsvc", "executors", "kernels"):
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            yield ".".join(parts), path


def imports_of(module: str, path: Path) -> list[tuple[str, int]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    pkg = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg[: len(pkg) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            # `from pkg import x`: x is a submodule or an attribute of pkg; judge pkg.x
            found += [(f"{name}.{a.name}", node.lineno) for a in node.names]
    return found


def test_imports_point_down():
    bad = []
    for module, path in source_modules():
        mine = layer_of(module)
        for name, line in imports_of(module, path):
            theirs = layer_of(name)
            if theirs is None or theirs == mine:
                continue
            if LAYERS.index(theirs) < LAYERS.index(mine):
                bad.append(f"{path.relative_to(ROOT)}:{line} ({mine}) imports {name} ({theirs})")
    assert not bad, "upward imports:\n" + "\n".join(bad)


def test_client_depends_only_on_stubs_and_grpc():
    bad = []
    for module, path in source_modules():
        if layer_of(module) != "client":
            continue
        for name, line in imports_of(module, path):
            if name.split(".")[0] in ("torch", "numpy", "transformers", "kernels", "executors") or (
                    layer_of(name) not in (None, "client") and not name.startswith("llmsvc.client")):
                if name == "llmsvc" or name.startswith(("llmsvc.client", "llmsvc.v1")) or name in CLIENT_SHARED:
                    continue
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
    assert not bad, "\n".join(bad)


def test_no_direct_torch_import_in_torch_free_layers():
    bad = []
    for module, path in source_modules():
        if not any(module == p or module.startswith(p + ".") for p in TORCH_FREE):
            continue
        if module.startswith("executors.") and module not in ("executors.base",):
            continue  # executor implementations own processes and may use torch.distributed
        for name, line in imports_of(module, path):
            if name.split(".")[0] == "torch":
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("package", ["llmsvc", "llmsvc.engine", "llmsvc.core", "llmsvc.client", "executors",
                                     "llmsvc.structured"])
def test_importing_torch_free_packages_does_not_load_torch(package):
    mods = [m for m, _ in source_modules() if m == package or (
        m.startswith(package + ".") and package != "llmsvc" and m != "executors.uniproc"
        and not m.startswith(("executors.multiproc", "executors.tensor_parallel", "executors.tp")))]
    code = ("import importlib, sys\n"
            f"for m in {mods!r}: importlib.import_module(m)\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
