"""The package's version: pyproject.toml's (the one place it is written), as the install records it."""
from __future__ import annotations

import functools


@functools.lru_cache(maxsize=1)
def installed_version() -> str:
    """Read once (importlib.metadata walks sys.path); a source tree on sys.path without an
    install has none."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("llmsvc")
    except PackageNotFoundError:
        return "0+unknown"
