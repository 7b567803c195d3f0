from __future__ import annotations

from dataclasses import dataclass

from fedguide.registry import Registry

MODELS: Registry = Registry("model", plugins=("fedguide.models",))


@dataclass(frozen=True)
class ModelSpec:
    """What a model builder needs to know about the data."""

    input_shape: tuple[int, ...]  # (C, H, W) for images, (L,) for token-id sequences
    num_classes: int
    vocab_size: int = 0  # text only: token ids are in [0, vocab_size), 0 = padding
