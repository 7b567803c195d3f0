"""The oracle's network: a small CNN on 32 x 32 RGB images in [-1, 1], and how images become its input.

Three 3x3 convolutions (BatchNorm, ReLU, 2x2 max-pooling each), a fully connected layer of ``width`` units
with ReLU (the penultimate features the oracle serves) and a linear classifier. Small on purpose: the pool
is a few thousand images at most, and training must take seconds to a minute on a CPU.
"""
from __future__ import annotations

import torch
from torch import nn

from fedguide.guidance.oracle import INPUT_SIDE
from fedguide.registry import ConfigError


def oracle_input(x: torch.Tensor) -> torch.Tensor:
    """Images in [-1, 1] ([B, 1 or 3, H, W]) as the oracle reads them: as the embedded models' pretraining reads
    its pool (float32 RGB, ``INPUT_SIDE`` square)."""
    from fedguide.guidance.embedded.pretrain.data import rgb_input

    if x.ndim != 4 or x.shape[1] not in (1, 3):
        raise ConfigError(f"images must be [B, 1 or 3, H, W] in [-1, 1], got shape {tuple(x.shape)}")
    return rgb_input(x, INPUT_SIDE)


class OracleNet(nn.Module):
    def __init__(self, num_classes: int, width: int, channels: tuple[int, ...]):
        super().__init__()
        layers: list[nn.Module] = []
        c_in, side = 3, INPUT_SIDE
        for c in channels:
            layers += [nn.Conv2d(c_in, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU(inplace=True),
                       nn.MaxPool2d(2)]
            c_in, side = c, side // 2
        self.body = nn.Sequential(*layers, nn.Flatten(), nn.Linear(c_in * side * side, width), nn.ReLU(inplace=True))
        self.head = nn.Linear(width, num_classes)
        self.width = width

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """Penultimate features [B, width] of images already in ``oracle_input`` form."""
        return self.body(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))
