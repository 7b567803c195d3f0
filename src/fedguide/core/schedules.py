"""Learning-rate schedules over rounds (``train.schedule``): the local learning rate of round r (from 1) as a pure
function of the base rate, the round and the run's length, so every runtime, worker and resumed process computes
the same rate for the same round.

- constant: ``lr``.
- exponential: ``lr * gamma^(r - 1)``, FedRCL's per-round decay (skynbe/FedRCL, trainers/base_trainer.py line 259,
  ``local_lr * local_lr_decay ** epoch`` with the round index from 0; skynbe/FedRCL/configs/trainer/base.yaml line 6:
  0.998).
- step: ``lr * gamma^floor((r - 1) / step_rounds)``, torch's StepLR over rounds.
- cosine: ``min_lr + (lr - min_lr) * (1 + cos(pi * (r - 1) / rounds)) / 2``, torch's CosineAnnealingLR with
  T_max = the run's rounds, stepped once per round.
"""
from __future__ import annotations

import math


def lr_at(name: str, lr: float, round_: int, rounds: int, gamma: float = 1.0, step_rounds: int = 1,
          min_lr: float = 0.0) -> float:
    t = round_ - 1
    if name == "constant":
        return lr
    if name == "exponential":
        return lr * gamma ** t
    if name == "step":
        return lr * gamma ** (t // step_rounds)
    if name == "cosine":
        return min_lr + (lr - min_lr) * (1.0 + math.cos(math.pi * t / rounds)) / 2.0
    raise ValueError(f"unknown schedule {name!r}; one of constant, exponential, step, cosine")
