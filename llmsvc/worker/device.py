"""Which device "auto" means on this machine (imports torch: call it where torch may load)."""
from __future__ import annotations

import torch


def resolve_device_type(name: str) -> str:
    """'auto' -> 'cuda' when a GPU is visible, else 'cpu'; 'cpu' and 'cuda' are returned as given."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name
