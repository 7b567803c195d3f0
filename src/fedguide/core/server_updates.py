"""Server optimisers as pure update rules on flat weight vectors (FedOpt).

Each rule takes the global weights ``x``, the round's aggregate ``aggregate`` and the optimiser's state, and
returns the next global weights and the next state. The pseudo-gradient is ``delta = aggregate - x`` (the
negative of Reddi et al.'s server "gradient", so every step is ``x + lr * direction``):

- FedAvgM (Hsu et al. 2019, "Measuring the effects of non-identical data distribution", Alg. 1):
  ``v = momentum * v + delta``; ``x = x + lr * v``. With momentum 0 and lr 1 it is FedAvg's aggregate.
- FedAdagrad, FedAdam, FedYogi (Reddi et al. 2021, "Adaptive federated optimization", Alg. 2):
  ``m = beta1 * m + (1 - beta1) * delta``;
  Adagrad ``v = v + delta^2``; Adam ``v = beta2 * v + (1 - beta2) * delta^2``;
  Yogi ``v = v - (1 - beta2) * delta^2 * sign(v - delta^2)``;
  ``x = x + lr * m / (sqrt(v) + tau)``, from ``m = 0`` and ``v = tau^2`` (the algorithm's ``v_{-1} >= tau^2``).
  Alg. 2 has no bias correction; ``bias_correction=True`` scales lr by ``sqrt(1 - beta2^t) / (1 - beta1^t)``
  at step t (Kingma & Ba's alpha_t), as Flower's ``FedAdam`` does (flwr/server/strategy/fedadam.py,
  lines 175-187, whose exponent is the server round plus one).

Only the entries under ``mask`` (the model's trainable parameters) move by the rule; the others (BatchNorm
statistics) take the aggregate as it is: an adaptive step on a running variance could make it negative.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

State = dict[str, torch.Tensor]


def _masked(x: torch.Tensor, aggregate: torch.Tensor, stepped: torch.Tensor,
            mask: Optional[torch.Tensor]) -> torch.Tensor:
    return stepped if mask is None else torch.where(mask, stepped, aggregate)


def avgm_step(x: torch.Tensor, aggregate: torch.Tensor, state: State, lr: float, momentum: float,
              mask: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, State]:
    """FedAvgM: server momentum on the pseudo-gradient."""
    delta = aggregate - x
    v = momentum * state["v"] + delta if "v" in state else delta.clone()
    return _masked(x, aggregate, x + lr * v, mask), {"v": v}


def adaptive_step(rule: str, x: torch.Tensor, aggregate: torch.Tensor, state: State, t: int, lr: float,
                  beta1: float, beta2: float, tau: float, bias_correction: bool = False,
                  mask: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, State]:
    """FedAdagrad (``rule='adagrad'``), FedAdam (``'adam'``) or FedYogi (``'yogi'``): server step ``t`` (1 for
    the first), from ``state`` (empty before the first)."""
    delta = aggregate - x
    m = state.get("m", torch.zeros_like(x))
    v = state.get("v", torch.full_like(x, tau * tau))
    m = beta1 * m + (1.0 - beta1) * delta
    sq = delta * delta
    if rule == "adagrad":
        v = v + sq
    elif rule == "adam":
        v = beta2 * v + (1.0 - beta2) * sq
    elif rule == "yogi":
        v = v - (1.0 - beta2) * sq * torch.sign(v - sq)
    else:
        raise ValueError(f"unknown adaptive rule {rule!r}; one of adagrad, adam, yogi")
    step = lr * math.sqrt(1.0 - beta2 ** t) / (1.0 - beta1 ** t) if bias_correction else lr
    stepped = x + step * m / (v.sqrt() + tau)
    return _masked(x, aggregate, stepped, mask), {"m": m, "v": v}
