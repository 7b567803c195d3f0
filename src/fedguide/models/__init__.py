"""Backbones split into encoder and head; importing this package registers every module in it."""
from __future__ import annotations

import importlib
import pkgutil
from typing import Any

from fedguide.models.registry import MODELS, ModelSpec
from fedguide.models.split import SplitModel

# One file per architecture family: a new module in this folder is registered without touching this file.
for _module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    if _module not in ("registry", "split") and not _module.startswith("_"):
        importlib.import_module(f"{__name__}.{_module}")


def build_model(name: str, params: Any, spec: ModelSpec) -> SplitModel:
    return MODELS.get(name).obj(params, spec)


__all__ = ["MODELS", "ModelSpec", "SplitModel", "build_model"]
