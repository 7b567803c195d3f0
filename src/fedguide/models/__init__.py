"""Backbones split into encoder and head, one module per architecture family; ``MODELS`` discovers every
public module in this package at its first lookup (a new module is registered without touching this file)."""
from __future__ import annotations

from typing import Any

from fedguide.models.registry import MODELS, ModelSpec
from fedguide.models.split import SplitModel

def build_model(name: str, params: Any, spec: ModelSpec) -> SplitModel:
    return MODELS.get(name).obj(params, spec)


__all__ = ["MODELS", "ModelSpec", "SplitModel", "build_model"]
