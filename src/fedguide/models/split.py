"""Every model is an encoder h (x -> z in R^d) followed by a head g (z -> logits)."""
from __future__ import annotations

from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn


class SplitModel(nn.Module):
    def __init__(self, encoder: nn.Module, head: nn.Module, feature_dim: int):
        super().__init__()
        self.encoder = encoder
        self.head = head
        self.feature_dim = feature_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))

    def forward_features(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(z, logits) in one pass, for objectives on the representation (MOON, FedProto, ...)."""
        z = self.encoder(x)
        return z, self.head(z)


class HeadParams(BaseModel):
    """Keys every model shares: FedDW's mapping layers and bias-free classification layer."""

    model_config = ConfigDict(extra="forbid")
    mapping: list[int] = Field(default_factory=list, description="widths of FC+ReLU mapping layers before the head")
    head_bias: bool = Field(True, description="false = classification layer without bias (FedDW)")


class BatchNormParams(BaseModel):
    """``batch_norm`` of an architecture built with BatchNorm layers: always true, declared so that a method
    requiring them (``model_requirements``, FedBN's) finds it as it finds it on models where it is an option."""

    batch_norm: Literal[True] = Field(True, description="the architecture normalises by batch (fixed)")


def assemble(encoder: nn.Sequential, feature_dim: int, num_classes: int, head: HeadParams) -> SplitModel:
    """Append the mapping layers to the encoder (z is their output) and add the classification layer."""
    layers = list(encoder)
    for width in head.mapping:
        layers += [nn.Linear(feature_dim, width), nn.ReLU(inplace=True)]
        feature_dim = width
    return SplitModel(nn.Sequential(*layers), nn.Linear(feature_dim, num_classes, bias=head.head_bias), feature_dim)
