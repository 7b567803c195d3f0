"""The local loop: epochs, or a fixed number of steps per client whatever its data size."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from fedguide.config import TrainConfig
from fedguide.core.training import train_local
from fedguide.methods import ClientContext
from fedguide.methods.base import Method
from fedguide.methods.compose import Regularizer


class Counting(Method):
    def __init__(self):
        super().__init__(None, None)
        self.batches: list[int] = []

    def local_loss(self, model, x, y, ctx, state):
        self.batches.append(len(y))
        return super().local_loss(model, x, y, ctx, state)


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


class OwnScale(Method):
    """A method with a parameter of its own (like FedNH's learned scale) and its own optimiser."""

    def __init__(self, boost: float = 1.0):
        super().__init__(None, None)
        self.boost = boost

    def begin_local(self, model, ctx):
        scale = nn.Parameter(torch.tensor(2.0))
        return scale, torch.optim.SGD([scale], lr=0.1)

    def local_optimizers(self, ctx, state):
        return [state[1]]

    def local_loss(self, model, x, y, ctx, state):
        return nn.functional.cross_entropy(state[0] * model(x), y) * self.boost


def _own_scale(precision, boost=1.0):
    torch.manual_seed(0)
    method, model = OwnScale(boost), nn.Linear(4, 3)
    ctx = ClientContext(0, 1, Data(16), {}, {})
    state = method.begin_local(model, ctx)
    train_local(model, method, ctx, TrainConfig(batch_size=8, lr=0.1, momentum=0.0, weight_decay=0.0,
                                                precision=precision), torch.Generator().manual_seed(0), state)
    return state[0].detach().item(), model.weight.detach().clone()


def test_a_methods_own_optimiser_steps_on_unscaled_gradients_under_fp16():
    # fp16 scales the loss by 65536 before backward: an owned optimiser stepping on those gradients would move the
    # scale by thousands; the loop unscales them with the model's.
    fp32, _ = _own_scale("fp32")
    fp16, _ = _own_scale("fp16")
    assert fp32 != 2.0 and abs(fp16 - fp32) < 1e-2 * abs(fp32 - 2.0) + 1e-3


def test_an_overflowing_step_is_skipped_for_the_methods_own_optimiser_too():
    scale, weight = _own_scale("fp16", boost=1e4)  # a finite loss whose scaled fp16 gradients overflow
    assert scale == 2.0  # every step overflowed: neither optimiser stepped
    torch.manual_seed(0)
    assert torch.equal(weight, nn.Linear(4, 3).weight.detach())


class Shift(Regularizer):
    """A term that reads its part of the payload: the loss plus ``shift``."""

    name = "shift"

    def loss(self, model, x, y, ctx, payload):
        return payload["shift"] + 0.0 * model(x).sum()


def test_the_loop_adds_each_regularisers_term_with_its_part_of_the_payload():
    def mean_loss(regularizers):
        method = Counting()
        method.regularizers = regularizers
        torch.manual_seed(0)
        ctx = ClientContext(0, 1, Data(8), {"shift": torch.tensor(100.0), "shift.shift": torch.tensor(5.0)}, {})
        loss, _ = train_local(nn.Linear(4, 3), method, ctx, TrainConfig(batch_size=8), torch.Generator().manual_seed(0))
        return loss

    assert mean_loss([Shift(None, None)]) == pytest.approx(mean_loss([]) + 5.0)
