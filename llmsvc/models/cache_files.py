"""The llmsvc cache on disk: where it is, and the file primitives its writers share.

    $LLMSVC_CACHE (default ~/.cache/llmsvc) / <16 hex of a .gguf's sha256> /   converted models (resolve.py)
                                             / derived /                       facts transformers derived (json_cache.py)

Standard library only, and no other llmsvc module: resolve.py (which coordinates finding a
model), checkpoint.py, json_cache.py and the tokenizer and config readers above it all use
these, so none of them has to import another for them.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os


def cache_root() -> str:
    return os.path.expanduser(os.environ.get("LLMSVC_CACHE") or os.path.join("~", ".cache", "llmsvc"))


def derived_cache_dir() -> str:
    """Where facts transformers derived from a model's files are kept (json_cache.py)."""
    return os.path.join(cache_root(), "derived")


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


@contextlib.contextmanager
def file_lock(path: str):
    """Hold an exclusive lock on `path` (created if absent): one process at a time converts a
    model; the lock goes with the process, so a killed holder never leaves it taken."""
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
