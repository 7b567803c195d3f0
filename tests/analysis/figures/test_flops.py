"""FLOPs of one local step (local_loss forward + backward) against FedAvg's, counted by torch's flop counter."""
import json

import pytest
import torch
from torch import nn

from fedguide.analysis import analyze
from fedguide.analysis.figures.flops import step_flops
from fedguide.data.federated import ClientData
from fedguide.methods.base import ClientContext
from fedguide.methods.classic.fedavg import FedAvg
from fedguide.models.split import SplitModel
from fedguide.registry import ConfigError, NoParams


def test_linear_model_step_hand_computed():
    torch.manual_seed(0)
    model = SplitModel(nn.Sequential(nn.Flatten(), nn.Linear(4, 3)), nn.Linear(3, 2), 3)
    data = ClientData(0, torch.arange(8), torch.randn(8, 1, 2, 2), torch.randint(0, 2, (8,)), 2)
    ctx = ClientContext(0, 1, data, {}, {})
    total, per_op = step_flops(FedAvg(NoParams(), None), model, ctx, torch.arange(8))
    forward = 2 * 8 * (4 * 3 + 3 * 2)  # two matrix products of 2·B·in·out
    weight_grads = forward
    input_grad = 2 * 8 * 3 * 2  # only the head passes a gradient down (the input needs none)
    assert total == forward + weight_grads + input_grad
    assert per_op == {"addmm": forward, "mm": weight_grads + input_grad}
    assert all(p.grad is None for p in model.parameters())  # the count leaves no gradients behind


def test_fedavg_against_itself_is_one(fedavg_run):
    analyze(fedavg_run, ["flops"])
    data = json.loads((fedavg_run / "analysis" / "flops.json").read_text())
    assert data["ratio"] == 1.0 and data["flops"] == data["fedavg_flops"] > 0
    # the tiny MLP (64 -> 128 -> 64 -> 10), batch B: forward 2B·17024, weight grads the same, input grads
    # of the last two layers 2B·(128·64 + 64·10)
    b = data["batch_size"]
    assert b == 32 and data["flops"] == 2 * b * 17024 * 2 + 2 * b * (128 * 64 + 64 * 10)


def test_moon_adds_its_two_frozen_encoder_forwards(moon_run):
    analyze(moon_run, ["flops"])
    data = json.loads((moon_run / "analysis" / "flops.json").read_text())
    b = data["batch_size"]
    assert data["ratio"] > 1
    assert data["flops"] - data["fedavg_flops"] == 2 * (2 * b * (64 * 128 + 128 * 64))  # global + previous model
    assert (moon_run / "analysis" / "flops.png").stat().st_size > 0


def test_cached_denoising_targets_add_no_matrix_product(feddifrc_run):
    # NDCR compares z with features read from the cache: elementwise work, which the counter leaves out
    analyze(feddifrc_run, ["flops"])
    data = json.loads((feddifrc_run / "analysis" / "flops.json").read_text())
    assert data["method"] == "feddifrc" and data["ratio"] == 1.0


def test_a_one_shot_method_has_no_local_step(sd_gen_run):
    with pytest.raises(ConfigError, match="--flops does not apply.*trains its clients in a loop of its own"):
        analyze(sd_gen_run, ["flops"])
