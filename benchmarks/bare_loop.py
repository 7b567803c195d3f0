"""The floor every engine is measured against: the same SGD steps in a bare loop.

One model, one optimiser, random mini-batches gathered from one in-memory tensor, no framework.
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from fedguide.core.training import make_optimizer
from fedguide.models import ModelSpec, build_model


def batch_sizes(prepared, clients: list[int]) -> list[int]:
    """The mini-batch sizes the engine's local loop takes for these clients (one round)."""
    cfg = prepared.config.train
    sizes: list[int] = []
    for cid in clients:
        n = len(prepared.data.client_indices[cid])
        full, rest = divmod(n, cfg.batch_size)
        sizes += ([cfg.batch_size] * full + ([rest] if rest else [])) * cfg.epochs
    return sizes


class BareLoop:
    def __init__(self, prepared, seed: int = 0):
        cfg = prepared.config
        torch.manual_seed(seed)
        self.model = build_model(cfg.model.name, prepared.resolved.model.params,
                                 ModelSpec(prepared.data.splits.input_shape, prepared.data.num_classes))
        self.opt = make_optimizer(self.model, cfg.train)
        self.x, self.y = prepared.data.splits.train_x, prepared.data.splits.train_y
        self.gen = torch.Generator().manual_seed(seed)

    def run(self, sizes: list[int]) -> float:
        """Seconds for these steps."""
        self.model.train()
        t0 = time.perf_counter()
        for b in sizes:
            idx = torch.randint(0, len(self.y), (b,), generator=self.gen)
            loss = F.cross_entropy(self.model(self.x[idx]), self.y[idx])
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            self.opt.step()
        return time.perf_counter() - t0
