"""Which device "auto" means on this machine (imports torch: call it where torch may load)."""
from __future__ import annotations

import torch


def resolve_device_type(name: str) -> str:
    """'auto' -> 'cuda' when a GPU is visible, else 'cpu'; 'cpu' and 'cuda' are returned as given
    (ValueError for 'cuda' without a visible GPU)."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise ValueError(f"device cuda: torch sees no CUDA GPU here (torch {torch.__version__}, {build})")
    return name
