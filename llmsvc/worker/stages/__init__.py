"""The sampler's logits stages (see base.py). Importing the package registers every stage
module in it, so adding a stage is adding a file."""
from __future__ import annotations

import importlib
import pkgutil

from llmsvc.worker.stages.base import LogitsStage, Phase, StepRows, register, registered

for _module in pkgutil.iter_modules(__path__):
    if _module.name != "base":
        importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["LogitsStage", "Phase", "StepRows", "register", "registered"]
