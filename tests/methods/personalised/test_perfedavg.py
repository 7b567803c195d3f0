"""Per-FedAvg's meta-gradient on quadratics with a known answer (first-order and Hessian-free), and its
one-step personalisation."""
import pytest
import torch
import torch.nn.functional as F

from fedguide.core.seeding import torch_generator
from fedguide.methods._personalise import batch_stream
from fedguide.methods.personalised.perfedavg import meta_gradient
from tests.methods.pfl_cases import client_round, opened

# f_b(w) = ½ wᵀA_b w − b_bᵀw, ∇f_b = A_b w − b_b, ∇²f_b = A_b; one quadratic per batch D, D′, D″.
A = [torch.tensor([[2.0, 0.0], [0.0, 1.0]]), torch.tensor([[1.0, 0.0], [0.0, 3.0]]),
     torch.tensor([[2.0, 1.0], [1.0, 2.0]])]
B = [torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0]), torch.tensor([0.0, 0.0])]


def quadratic(w):
    return lambda b: 0.5 * w @ A[b].double() @ w - B[b].double() @ w


@pytest.mark.parametrize("variant, expected", [
    # w = (1, 1), α = 0.1: ∇f_D(w) = (1, 1), w̃ = (0.9, 0.9), ∇f_D′(w̃) = (0.9, 3·0.9 − 1) = (0.9, 1.7).
    ("fo", [0.9, 1.7]),
    # (I − α A_D″)(0.9, 1.7) = (0.9 − 0.1·3.5, 1.7 − 0.1·4.3) = (0.55, 1.27); the central difference is exact on
    # a quadratic.
    ("hf", [0.55, 1.27]),
])
def test_meta_gradient_on_a_quadratic(variant, expected):
    w = torch.tensor([1.0, 1.0], dtype=torch.float64, requires_grad=True)
    g, f_w = meta_gradient([w], quadratic(w), [0, 1, 2], alpha=0.1, variant=variant, delta=1e-3)
    assert torch.allclose(g[0], torch.tensor(expected, dtype=torch.float64), atol=1e-9)
    assert f_w.item() == pytest.approx(0.5)  # f_D(w) = ½(2 + 1) − 1
    assert torch.equal(w.detach(), torch.tensor([1.0, 1.0], dtype=torch.float64))  # w is left where it was


def test_fit_takes_the_meta_step_with_the_run_optimiser(tmp_path):
    # Plain SGD (no momentum, no decay) with lr β: the update is exactly −β · meta-gradient.
    train = {"momentum": 0.0, "weight_decay": 0.0, "local_steps": 1}
    ctx, method = opened(tmp_path, {"name": "perfedavg", "beta": 0.2, "alpha": 0.05}, train=train)
    start = ctx.initial_weights.clone()
    client_round(ctx, method, 0, 1, start)
    after = ctx.layout.flatten(ctx.model)
    # Redo the step by hand: the same client stream gives the same two batches.
    ctx.layout.load(ctx.model, start)
    data = ctx.data.client(0)
    stream = batch_stream(data.indices, ctx.config.train.batch_size,
                          torch_generator(ctx.config.seed, "client", 1, 0))
    batches = [next(stream) for _ in range(2)]
    params = list(ctx.model.parameters())
    g, _ = meta_gradient(params, lambda b: F.cross_entropy(ctx.model(data.x[b]), data.y[b]), batches, 0.05, "fo", 1e-3)
    expected = torch.cat([(p.detach() - 0.2 * gi).reshape(-1) for p, gi in zip(params, g)])
    assert torch.allclose(after, expected, atol=1e-6)


def test_personalisation_is_one_alpha_step_from_the_global_model(tmp_path):
    ctx, method = opened(tmp_path, {"name": "perfedavg", "alpha": 0.5, "personal_steps": 1})
    glob = ctx.initial_weights.clone()
    personal = method.personal_model(1, 2, glob)
    # By hand: w − α ∇f(w; D) on the first batch of the client's personalisation stream.
    ctx.layout.load(ctx.model, glob)
    data = ctx.data.client(2)
    batch = next(batch_stream(data.indices, ctx.config.train.batch_size,
                              torch_generator(ctx.config.seed, "personal", 1, 2)))
    params = list(ctx.model.parameters())
    grads = torch.autograd.grad(F.cross_entropy(ctx.model(data.x[batch]), data.y[batch]), params)
    expected = torch.cat([(p.detach() - 0.5 * g).reshape(-1) for p, g in zip(params, grads)])
    assert torch.allclose(personal, expected, atol=1e-6)
    assert torch.equal(method.personal_model(1, 2, glob), personal)  # seeded by (seed, round, client)
