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
SHARED = {"llmsvc.config", "llmsvc.speculative_config", "llmsvc.sampling_params", "llmsvc.wire", "llmsvc.outputs",
          "llmsvc.engine_request", "llmsvc.sampling_fields", "llmsvc.sampling_params_error", "llmsvc.structured_params",
          "llmsvc.chat_content", "llmsvc.version"}
# the dependency-free declarations the client derives its flags from
CLIENT_SHARED = {"llmsvc.sampling_params", "llmsvc.sampling_params.SamplingParams", "llmsvc.sampling_fields",
                 "llmsvc.sampling_fields.declared", "llmsvc.sampling_params_error", "llmsvc.structured_params",
                 "llmsvc.chat_content", "llmsvc.chat_content.joined_text"}
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


def _type_checking_lines(tree: ast.AST) -> set[int]:
    """Lines under `if TYPE_CHECKING:`: imports a type checker reads and Python never runs."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for stmt in node.body:
                lines.update(range(stmt.lineno, (stmt.end_lineno or stmt.lineno) + 1))
    return lines


def import_graph(modules: dict[str, Path]) -> dict[str, dict[str, int]]:
    """module -> {project module it imports: line}. Imports inside functions count as much as
    those at the top: a local import only puts a circle off until that function first runs.
    `from pkg.mod import name` is an edge to pkg.mod (to pkg when name is a submodule of it:
    pkg.name); a package's own __init__ running first is not an edge (it would make every
    package that imports its submodules a circle)."""
    graph: dict[str, dict[str, int]] = {}
    for module, path in modules.items():
        skip = _type_checking_lines(ast.parse(path.read_text(), filename=str(path)))
        edges: dict[str, int] = {}
        for name, line in imports_of(module, path):
            while name and name not in modules:  # an attribute of a module: the module
                name = name.rpartition(".")[0]
            if name and name != module and line not in skip:
                edges.setdefault(name, line)
        graph[module] = edges
    return graph


def import_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def describe_cycles(graph: dict[str, dict[str, int]], modules: dict[str, Path], root: Path = ROOT) -> str:
    out = []
    for component in import_cycles(graph):
        out.append("circle: " + ", ".join(component))
        out += [f"  {modules[m].relative_to(root)}:{line} imports {dep}"
                for m in component for dep, line in graph[m].items() if dep in component]
    return "\n".join(out)


def test_no_import_cycles():
    modules = dict(source_modules())
    graph = import_graph(modules)
    assert not import_cycles(graph), "import circles (move what both sides need into a module of its own):\n" \
        + describe_cycles(graph, modules)


def test_import_cycle_finder_sees_function_local_imports(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from pkg import a\n")
    (pkg / "a.py").write_text("from pkg.b import helper\n")
    (pkg / "b.py").write_text("def helper():\n    from pkg.a import thing  # hidden in a function\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.d import T\n")
    (pkg / "d.py").write_text("import pkg.c\n")
    modules = {"pkg": pkg / "__init__.py", **{f"pkg.{n}": pkg / f"{n}.py" for n in "abcd"}}
    graph = import_graph(modules)
    assert import_cycles(graph) == [["pkg.a", "pkg.b"]]  # not pkg / pkg.a, nor the TYPE_CHECKING one
    assert "pkg/b.py:2 imports pkg.a" in describe_cycles(graph, modules, tmp_path)
