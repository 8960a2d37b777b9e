"""Small JSON facts derived from a model's files by transformers, kept under the llmsvc cache.

An entry's name hashes the bytes of the files the fact depends on, their directory, the
transformers version that derived it and CACHE_VERSION, so an edited file or an upgraded
transformers finds no entry and derives the fact again. Writes are atomic (temporary file +
rename): concurrent processes see no entry or a whole one. A cache directory that cannot be
written only means no cache. Imports neither torch nor transformers.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import tempfile

from llmsvc.models.cache_files import file_sha256

CACHE_VERSION = 1  # bump when what is stored (or how it is read) changes


def entry_path(cache_dir: str, kind: str, files: list[str], where: str = "") -> str:
    """cache_dir/<hash>.<kind>.json for the current bytes of `files` (absent files count as
    absent) read from `where` (transformers records the directory's path, `_name_or_path`, and
    matches some choices on it)."""
    h = hashlib.sha256(f"{CACHE_VERSION}\0{_transformers_version()}\0{kind}\0{where}".encode())
    for path in files:
        h.update(f"\0{os.path.basename(path)}\0".encode())
        try:
            h.update(file_sha256(path).encode())
        except FileNotFoundError:
            h.update(b"\0absent")
    return os.path.join(cache_dir, f"{h.hexdigest()[:32]}.{kind}.json")


def read(path: str) -> dict | None:
    """The entry, or None when there is none or it cannot be parsed (then it is derived again)."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def write(path: str, data: dict) -> None:
    tmp = None
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=os.path.dirname(path))
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # as the converted models beside it (mkstemp made it 0600)
        os.replace(tmp, path)
    except OSError:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)


def _transformers_version() -> str:
    try:
        return importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return "none"
