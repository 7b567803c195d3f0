from __future__ import annotations

from dataclasses import dataclass

from fedguide.registry import Registry

MODELS: Registry = Registry("model")


@dataclass(frozen=True)
class ModelSpec:
    """What a model builder needs to know about the data."""

    input_shape: tuple[int, int, int]
    num_classes: int
