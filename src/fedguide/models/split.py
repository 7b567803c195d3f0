"""Every model is an encoder h (x -> z in R^d) followed by a head g (z -> logits)."""
from __future__ import annotations

import torch
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
