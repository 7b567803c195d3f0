"""The local loop: epochs, or a fixed number of steps per client whatever its data size."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from fedguide.config import TrainConfig
from fedguide.core.training import train_local
from fedguide.methods import ClientContext
from fedguide.methods.base import Method


class Counting(Method):
    def __init__(self):
        super().__init__(None, None)
        self.batches: list[int] = []

    def local_loss(self, model, x, y, ctx):
        self.batches.append(len(y))
        return super().local_loss(model, x, y, ctx)


class Data:
    def __init__(self, n):
        self.indices, self.x, self.y = torch.arange(n), torch.randn(n, 4), torch.arange(n) % 3

    def __len__(self):
        return len(self.indices)


def _train(n, **cfg):
    method, model = Counting(), nn.Linear(4, 3)
    ctx = ClientContext(0, 1, Data(n), {}, {})
    loss, steps = train_local(model, method, ctx, TrainConfig(batch_size=8, **cfg), torch.Generator().manual_seed(0))
    return steps, method.batches


@pytest.mark.parametrize("n, epochs, expected", [(20, 1, [8, 8, 4]), (20, 2, [8, 8, 4] * 2), (3, 1, [3])])
def test_epochs_pass_over_the_data(n, epochs, expected):
    steps, batches = _train(n, epochs=epochs)
    assert batches == expected and steps == len(expected)


@pytest.mark.parametrize("n", [3, 20, 100])
def test_local_steps_is_the_same_for_every_client_size(n):
    steps, batches = _train(n, local_steps=7, epochs=5)
    assert steps == 7 and len(batches) == 7
    assert all(0 < b <= 8 for b in batches)
    if n == 3:
        assert batches == [3] * 7  # a tiny client passes over its data seven times
