"""An extra condition vector injected into the UNet's cross-attention context (FedDifRC's c_i = h(x_i)).

The client encoder's output lives in its own d-dimensional space; a fixed linear map, seeded and never
trained, carries it to the text encoder's hidden size (a decision where FedDifRC is silent). Modes:
``append`` adds it as one extra context token (the default decision), ``add`` adds it to every token
(the released code), ``none`` leaves the context as it is.
"""
from __future__ import annotations

from typing import Literal

import torch

from fedguide.registry import ConfigError

ConditionMode = Literal["append", "add", "none"]


class ConditionMap:
    def __init__(self, in_dim: int, hidden: int, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        # Scaled like a default-initialised linear layer, so the token is of the size of text tokens.
        self.weight = torch.randn(hidden, in_dim, generator=gen) / in_dim ** 0.5
        self.in_dim, self.hidden, self.seed = in_dim, hidden, seed

    def __call__(self, cond: torch.Tensor) -> torch.Tensor:
        if cond.shape[-1] != self.in_dim:
            raise ConfigError(f"condition vectors have {cond.shape[-1]} dims, the map expects {self.in_dim}")
        return cond @ self.weight.to(cond.device, cond.dtype).T


def inject(context: torch.Tensor, cond: torch.Tensor | None, mode: ConditionMode, cmap: ConditionMap | None) -> torch.Tensor:
    """Context [B, L, H] with the condition [B, in_dim] injected per ``mode``."""
    if mode == "none" or cond is None:
        return context
    if cmap is None:
        raise ConfigError(f"condition_mode={mode} needs a ConditionMap for the condition vectors")
    token = cmap(cond.to(context.device, context.dtype))[:, None, :]
    if mode == "append":
        return torch.cat([context, token], dim=1)
    if mode == "add":
        return context + token
    raise ConfigError(f"unknown condition_mode '{mode}'; use append, add or none")
