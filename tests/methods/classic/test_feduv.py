"""FedUV's two terms on hand-computed batches, and the method's local objective."""
import math

import pytest
import torch
import torch.nn.functional as F

from fedguide.methods.classic.feduv import iid_target_std, uniformity_loss, variance_loss
from tests.methods.pfl_cases import opened


def test_target_std_is_the_deviation_of_a_one_hot_column():
    # a column of the 4x4 identity: 1, 0, 0, 0 -> mean 1/4, unbiased variance (9/16 + 3/16)/3 = 1/4
    assert iid_target_std(4) == pytest.approx(0.5)
    assert iid_target_std(10) == pytest.approx(torch.eye(10).std(dim=0).mean().item())


def test_variance_hinge_on_a_two_sample_batch():
    # softmax rows (1/2, 1/2) and (3/4, 1/4): each column has values 1/2 and 3/4 (or 1/2, 1/4), unbiased
    # std sqrt(2 * (1/8)^2 / 1) = sqrt(2)/8; gamma = sqrt(1/2): L_V = sqrt(1/2) - sqrt(2)/8 for both columns
    logits = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0]])
    assert variance_loss(logits, iid_target_std(2)).item() == pytest.approx(math.sqrt(0.5) - math.sqrt(2) / 8, rel=1e-6)


def test_variance_hinge_is_zero_once_every_column_is_spread_enough():
    confident = torch.tensor([[20.0, 0.0], [0.0, 20.0]])  # columns (~1, ~0): std ~ 0.707 >= gamma 0.5
    assert variance_loss(confident, 0.5).item() == pytest.approx(0.0, abs=1e-7)
    collapsed = torch.tensor([[20.0, 0.0], [20.0, 0.0]])  # every sample predicts class 0: std 0 -> gamma
    assert variance_loss(collapsed, 0.5).item() == pytest.approx(0.5, abs=1e-6)


def test_uniformity_on_three_points_with_the_median_bandwidth():
    # squared distances 1, 4, 5: sigma = 4; L_U = (e^{-1/4} + e^{-1} + e^{-5/4}) / 3
    z = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 2.0]])
    expected = (math.exp(-0.25) + math.exp(-1.0) + math.exp(-1.25)) / 3
    assert uniformity_loss(z).item() == pytest.approx(expected, rel=1e-6)
    # scale-free: the bandwidth follows the distances
    assert uniformity_loss(10 * z).item() == pytest.approx(expected, rel=1e-5)


def test_uniformity_gradient_with_a_constant_bandwidth_spreads_close_points_apart():
    z = torch.tensor([[0.0, 0.0], [0.1, 0.0], [3.0, 0.0], [0.0, 3.0]], requires_grad=True)
    uniformity_loss(z, detach_bandwidth=True).backward()
    stepped = (z - 0.1 * z.grad).detach()
    assert torch.dist(stepped[0], stepped[1]) > torch.dist(z[0].detach(), z[1].detach())


def test_degenerate_batches_give_zero_and_keep_the_graph():
    one = torch.randn(1, 3, requires_grad=True)
    assert variance_loss(one, 0.3).item() == 0.0 and uniformity_loss(one).item() == 0.0
    same = torch.ones(4, 3, requires_grad=True)
    value = uniformity_loss(same)
    assert value.item() == 0.0
    value.backward()  # still attached: a composed loss can backpropagate through it


def test_local_loss_is_ce_plus_weighted_terms(tmp_path):
    ctx, method = opened(tmp_path, {"name": "feduv", "var_weight": 2.0, "unif_weight": 0.25})
    data = ctx.data.client(0)
    x, y = data.x[:16], data.y[:16]
    model = ctx.model
    with torch.no_grad():
        z, logits = model.forward_features(x)
        expected = (F.cross_entropy(logits, y) + 2.0 * variance_loss(logits, iid_target_std(10))
                    + 0.25 * uniformity_loss(z))
        got = method.local_loss(model, x, y, None, None)
    assert got.item() == pytest.approx(expected.item(), rel=1e-6)
    assert method.gamma == pytest.approx(math.sqrt(0.1))
