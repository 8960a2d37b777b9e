"""Build one C source of kernels/cpu_ops twice (a committed revision and the working tree) into
libraries of their own, so an A/B harness can load both in one process and call them in turn.
A slow phase of a shared machine then hits both builds alike (benchmarks.attention_ab,
benchmarks.gemm_ab)."""
from __future__ import annotations

import ctypes
import fnmatch
import glob
import os
import subprocess
from concurrent.futures import ThreadPoolExecutor

from kernels.cpu_ops import build


def files_at(patterns: list[str], rev: str | None) -> list[str]:
    """The paths matching the glob patterns as committed at git revision `rev` (None: in the
    working tree), pattern by pattern: a kernel split into more files at one revision than at the
    other still builds at both."""
    if rev is None:
        return [p for pat in patterns for p in sorted(glob.glob(pat))]
    listed = subprocess.check_output(["git", "ls-tree", "-r", "--name-only", rev], text=True).split()
    return [p for pat in patterns for p in sorted(fnmatch.filter(listed, pat))]


def sources(paths: list[str], base: str) -> tuple[list[str], list[str]]:
    """(the texts of the files `paths` (globs) match at git revision `base`, those in the working tree)"""
    base_src = [subprocess.check_output(["git", "show", f"{base}:{path}"], text=True) for path in files_at(paths, base)]
    new_src = []
    for path in files_at(paths, None):
        with open(path) as f:
            new_src.append(f.read())
    return base_src, new_src


def headers_at(rev: str, out_dir: str) -> str:
    """A folder of out_dir holding the kernels' headers as committed at git revision `rev`."""
    folder = os.path.join(out_dir, "include-" + "".join(c if c.isalnum() else "_" for c in rev))
    os.makedirs(folder, exist_ok=True)
    listed = subprocess.check_output(["git", "ls-tree", "--name-only", rev, "kernels/cpu_ops/"], text=True)
    for path in listed.split():
        if path.endswith(".h"):
            with open(os.path.join(folder, os.path.basename(path)), "w") as f:
                f.write(subprocess.check_output(["git", "show", f"{rev}:{path}"], text=True))
    return folder


def compile_entry(texts: list[str], tag: str, out_dir: str, entry: str, argtypes, restype=ctypes.c_int,
                  rev: str | None = None):
    """The source texts, one translation unit each, compiled alone (they need only their
    headers: those committed at `rev`, or the working tree's) and linked into a library; its
    `entry` (`.lib`: the library)."""
    root = headers_at(rev, out_dir) if rev else os.path.dirname(os.path.abspath(build.__file__))
    cc = os.environ.get("CC", "cc")
    objs = []
    for i, text in enumerate(texts):
        src, obj = (os.path.join(out_dir, f"{tag}{i}.{ext}") for ext in ("c", "o"))
        with open(src, "w") as f:
            f.write(text)
        subprocess.check_call([cc, *build._CFLAGS, "-I", root, "-c", src, "-o", obj])
        objs.append(obj)
    so = os.path.join(out_dir, f"{tag}.so")
    # compiled with the engine's flags, linked without -ffast-math as build.py does: linking
    # with it would set flush-to-zero for this whole process when the library loads
    subprocess.check_call([cc, *objs, *build._LDFLAGS, "-o", so])
    lib = ctypes.CDLL(so)
    fn = getattr(lib, entry)
    fn.restype, fn.argtypes = restype, argtypes
    fn.lib = lib  # the library's other symbols (e.g. a layout query)
    return fn


def compile_pair(paths: list[str], base: str, out_dir: str, entry: str, argtypes) -> dict:
    """{base: the sources `paths` (globs; linked together) as committed at git revision `base`, "tree":
    as in the working tree}, each compiled by compile_entry; the two compilers run side by side
    (each takes seconds)."""
    base_src, new_src = sources(paths, base)
    with ThreadPoolExecutor(2) as pool:
        jobs = {base: pool.submit(compile_entry, base_src, "base", out_dir, entry, argtypes, rev=base),
                "tree": pool.submit(compile_entry, new_src, "tree", out_dir, entry, argtypes)}
        return {tag: job.result() for tag, job in jobs.items()}
