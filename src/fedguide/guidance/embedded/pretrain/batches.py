"""Seeded batch draws. The UNet stage's are a pure function of the step, so a run resumed from a
checkpoint draws the batches an uninterrupted run would have."""
from __future__ import annotations

import numpy as np
import torch


def epoch_batches(n: int, batch: int, gen: torch.Generator):
    """Endless batches of a fresh permutation per epoch, drawn from ``gen`` (the remainder is dropped)."""
    while True:
        perm = torch.randperm(n, generator=gen)
        for start in range(0, n - batch + 1, batch):
            yield perm[start:start + batch]


class StepBatches:
    """The batch of step i, a pure function of (seed, i): a resumed stage draws the same batches."""

    def __init__(self, n: int, batch: int, seed: int):
        self.n, self.batch, self.seed = n, batch, seed
        self.per_epoch = max(1, n // batch)
        self._epoch, self._perm = -1, None

    def __call__(self, step: int) -> torch.Tensor:
        epoch, pos = divmod(step, self.per_epoch)
        if epoch != self._epoch:
            self._perm = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed * 100_003 + epoch))
            self._epoch = epoch
        return self._perm[pos * self.batch:(pos + 1) * self.batch]


class MixedStepBatches:
    """Like StepBatches, with a fixed number of each group's items in every batch (each group cycles
    through its own seeded permutations, so a small group is revisited more often than a large one)."""

    def __init__(self, groups: torch.Tensor, shares: tuple[float, ...], batch: int, seed: int):
        counts = [int(round(share * batch)) for share in shares]
        counts[int(np.argmax(counts))] += batch - sum(counts)
        self.parts = [(members, StepBatches(len(members), count, seed * 7919 + g))
                      for g, count in enumerate(counts) if count > 0
                      for members in [torch.nonzero(groups == g).flatten()]]

    def __call__(self, step: int) -> torch.Tensor:
        return torch.cat([members[draw(step)] for members, draw in self.parts])
