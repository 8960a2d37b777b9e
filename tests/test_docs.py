"""The documentation stays a front page plus docs/ that point only at files in this repository."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 200
# [text](target) and ![alt](target); the target ends at whitespace or ")"
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
# [text]: target (reference-style definitions)
REF_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$", re.M)
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)


def tracked_files() -> set[str]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    return {p for p in out.decode().split("\0") if p}


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def relative_links(text: str) -> list[str]:
    """Link targets that are not URLs or in-page anchors, outside fenced code blocks."""
    text = FENCE.sub("", text)
    targets = LINK.findall(text) + REF_DEF.findall(text)
    return [t for t in targets if not re.match(r"^[a-z][a-z0-9+.-]*:", t, re.I) and not t.startswith("#")]


def resolve(doc: Path, target: str) -> str:
    """The repository path a link in `doc` points at (anchor and query dropped)."""
    path = unquote(target.split("#", 1)[0].split("?", 1)[0])
    full = (doc.parent / path).resolve() if not path.startswith("/") else (ROOT / path.lstrip("/")).resolve()
    try:
        return full.relative_to(ROOT).as_posix()
    except ValueError:
        return "../" + path  # outside the repository


def test_readme_is_a_front_page():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines (at most {README_MAX_LINES})"


def test_link_parsing_finds_relative_links_and_ignores_urls_and_code():
    text = ("See [design](docs/design.md#layers), ![plot](img/a.png \"title\") and [web](https://x.org).\n"
            "[ref]: ../outside.md\n```\n[in code](nope.md)\n```\n[top](#top)\n")
    assert relative_links(text) == ["docs/design.md#layers", "img/a.png", "../outside.md"]
    assert resolve(ROOT / "docs" / "api.md", "design.md#x") == "docs/design.md"
    assert resolve(ROOT / "README.md", "../elsewhere/notes.md").startswith("../")


@pytest.mark.parametrize("doc", doc_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve_to_tracked_files(doc):
    tracked = tracked_files()
    folders = {str(Path(p).parent.as_posix()) for p in tracked}
    broken = []
    for target in relative_links(doc.read_text()):
        path = resolve(doc, target)
        if path not in tracked and path.rstrip("/") not in folders:
            broken.append(target)
    assert not broken, f"{doc.relative_to(ROOT)} links to files not tracked in the repository: {broken}"


def test_documentation_exists_and_is_linked_from_the_readme():
    readme = ROOT / "README.md"
    linked = {resolve(readme, t) for t in relative_links(readme.read_text())}
    docs = {p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md")}
    assert {"docs/design.md", "docs/api.md", "docs/cpu-kernels.md", "docs/gpu.md", "docs/benchmarks.md"} <= docs
    assert docs <= linked, f"docs not linked from README.md: {sorted(docs - linked)}"


def test_no_tracked_file_points_outside_the_repository():
    # the literal is split so that this file does not match itself
    needle = "../" + "shared"
    bad = []
    for rel in sorted(tracked_files()):
        path = ROOT / rel
        if not path.is_file():
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # binary
        if needle in text:
            bad.append(rel)
    assert not bad, f"files mentioning {needle!r}: {bad}"


PY_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def undefined_names(code: str) -> set[str]:
    """Names a snippet reads but neither imports, assigns, defines nor gets from builtins (a
    snippet is run as written: it must stand on its own)."""
    import ast
    import builtins
    tree = ast.parse(code)
    bound = set(dir(builtins))
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            bound |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
            bound |= {a.arg for a in ast.walk(node.args) if isinstance(a, ast.arg)}
        elif isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            bound.add(node.id)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)} - bound


def test_undefined_names_are_found():
    assert undefined_names("import json\nx = json.loads(s)\nprint(x, len([y for y in x]))") == {"s"}


@pytest.mark.parametrize("doc", doc_files(), ids=lambda p: p.name)
def test_python_snippets_name_only_what_they_define(doc):
    for block in PY_BLOCK.findall(doc.read_text()):
        assert not undefined_names(block), f"{doc.name}: a snippet uses {undefined_names(block)}:\n{block}"
