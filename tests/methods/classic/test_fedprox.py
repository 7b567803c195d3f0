"""FedProx's proximal term (mu/2)·||w − w_global||² and its use in the local loss."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedguide.methods import ClientContext
from fedguide.methods.classic.fedprox import FedProx, FedProxParams, proximal_term


def leaf(values):
    return torch.tensor(values, requires_grad=True)


def hand_case():
    params = [leaf([1.0, 2.0]), leaf([[3.0]])]
    anchor = [torch.tensor([0.0, 0.5]), torch.tensor([[1.0]])]
    return params, anchor


def test_value_hand_computed():
    params, anchor = hand_case()
    # differences [1, 1.5] and [[2]]: squared norm 1 + 2.25 + 4 = 7.25; times mu/2 = 0.05
    value = proximal_term(params, anchor, 0.1)
    assert value.dim() == 0
    assert value.item() == pytest.approx(0.05 * 7.25, rel=1e-6)
    assert value.item() == pytest.approx(0.3625, rel=1e-6)


def test_gradient_hand_computed():
    params, anchor = hand_case()
    proximal_term(params, anchor, 0.1).backward()
    # d/dw (mu/2)||w - a||² = mu (w - a)
    assert torch.allclose(params[0].grad, torch.tensor([0.1, 0.15]))
    assert torch.allclose(params[1].grad, torch.tensor([[0.2]]))
    assert params[1].grad.shape == (1, 1)


def test_anchor_gets_no_gradient():
    params = [leaf([1.0, 2.0])]
    anchor = [leaf([0.0, 0.0])]
    proximal_term(params, [a.detach() for a in anchor], 1.0).backward()
    assert anchor[0].grad is None


def test_mu_zero_gives_zero():
    params, anchor = hand_case()
    value = proximal_term(params, anchor, 0.0)
    assert value.item() == 0.0
    value.backward()
    assert all(torch.count_nonzero(p.grad) == 0 for p in params)


def test_zero_at_anchor_with_finite_zero_gradient():
    # At the start of local training w == w_global; the gradient of a norm is undefined at 0,
    # the gradient of the squared norm is 0 — it must not come out as NaN.
    params = [leaf([1.0, -2.0]), leaf([[3.0, 4.0]])]
    anchor = [p.detach().clone() for p in params]
    value = proximal_term(params, anchor, 0.5)
    assert value.item() == 0.0
    value.backward()
    for p in params:
        assert torch.isfinite(p.grad).all()
        assert torch.count_nonzero(p.grad) == 0


def test_is_squared_norm():
    params, anchor = hand_case()
    base = proximal_term(params, anchor, 0.1).item()
    doubled = [a + 2 * (p.detach() - a) for p, a in zip(params, anchor)]  # twice as far from the anchor
    far = proximal_term(doubled, anchor, 0.1).item()
    assert far == pytest.approx(4 * base, rel=1e-6), "doubling the distance must quadruple the term"


def test_linear_in_mu():
    params, anchor = hand_case()
    a = proximal_term(params, anchor, 0.1).item()
    b = proximal_term(params, anchor, 0.3).item()
    assert b == pytest.approx(3 * a, rel=1e-6)


def test_params_default_and_validation():
    assert FedProxParams().mu == 0.001
    with pytest.raises(ValueError):
        FedProxParams(mu=-0.1)
    with pytest.raises(ValueError):
        FedProxParams(nu=1)


def _ctx():
    return ClientContext(client_id=0, round=1, data=None, payload={}, state={})


@pytest.mark.parametrize("mu", [0.0, 0.5])
def test_local_loss_adds_proximal_term(mu):
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    method = FedProx(FedProxParams(mu=mu, gradient="autograd"), run=None)
    ctx = _ctx()
    state = method.begin_local(model, ctx)
    x, y = torch.randn(4, 3), torch.tensor([0, 1, 1, 0])

    # At the anchor the loss is plain cross-entropy.
    assert method.local_loss(model, x, y, ctx, state).item() == pytest.approx(F.cross_entropy(model(x), y).item())

    # Move the weights; the anchor is a snapshot and stays put.
    with torch.no_grad():
        model.weight.add_(1.0)
    ce = F.cross_entropy(model(x), y).item()
    expected = ce + 0.5 * mu * model.weight.numel()  # each of the 6 weights moved by 1
    assert method.local_loss(model, x, y, ctx, state).item() == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("mu", [0.0, 0.3])
def test_direct_gradient_equals_autograd_of_the_proximal_objective(mu):
    # Hand check: weights moved by +1 from the anchor -> proximal gradient mu·1 on every weight.
    torch.manual_seed(0)
    x, y = torch.randn(4, 3), torch.tensor([0, 1, 1, 0])
    grads = {}
    for mode in ("direct", "autograd"):
        model = nn.Linear(3, 2)
        torch.manual_seed(1)
        model.reset_parameters()
        method = FedProx(FedProxParams(mu=mu, gradient=mode), run=None)
        ctx = _ctx()
        state = method.begin_local(model, ctx)
        with torch.no_grad():
            model.weight.add_(1.0)
        model.zero_grad()
        method.local_loss(model, x, y, ctx, state).backward()
        method.after_backward(model, ctx, state)
        grads[mode] = (model.weight.grad.clone(), model.bias.grad.clone())
    torch.testing.assert_close(grads["direct"][0], grads["autograd"][0])
    torch.testing.assert_close(grads["direct"][1], grads["autograd"][1])
    # and the difference to the bare cross-entropy gradient is exactly mu on the moved weights
    model = nn.Linear(3, 2)
    torch.manual_seed(1)
    model.reset_parameters()
    with torch.no_grad():
        model.weight.add_(1.0)
    F.cross_entropy(model(x), y).backward()
    torch.testing.assert_close(grads["direct"][0] - model.weight.grad, torch.full((2, 3), mu))
    torch.testing.assert_close(grads["direct"][1] - model.bias.grad, torch.zeros(2))
