"""Backbones split into encoder and head; importing this package registers them all."""
from __future__ import annotations

from typing import Any

from fedguide.models.registry import MODELS, ModelSpec
from fedguide.models.split import SplitModel
from fedguide.models import cnn, mlp, resnet  # noqa: F401


def build_model(name: str, params: Any, spec: ModelSpec) -> SplitModel:
    return MODELS.get(name).obj(params, spec)


__all__ = ["MODELS", "ModelSpec", "SplitModel", "build_model"]
