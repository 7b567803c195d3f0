"""Per-FedAvg's meta-gradient on quadratics with a known answer (first-order and Hessian-free), the released
meta step (FedDW's Updata.py L543-593: plain SGD, β 1e-3, one batch for both gradients), and its one-step
personalisation."""
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
    ctx, method = opened(tmp_path, {"name": "perfedavg", "beta": 0.2, "alpha": 0.05, "beta_step": "optimizer",
                                    "batches": "independent"}, train=train)
    start = ctx.initial_weights.clone()
    client_round(ctx, method, 0, 1, start)
    after = ctx.layout.flatten(ctx.model)
    # Redo the step by hand: the same client stream gives the same two batches.
    ctx.layout.load(ctx.model, start)
    data = ctx.data.client(0)
    stream = batch_stream(data.indices, ctx.config.train.batch_size,
                          torch_generator(ctx.config.seed, "client", 1, 0))
    batches = [next(stream)[0] for _ in range(2)]
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
                              torch_generator(ctx.config.seed, "personal", 1, 2)))[0]
    params = list(ctx.model.parameters())
    grads = torch.autograd.grad(F.cross_entropy(ctx.model(data.x[batch]), data.y[batch]), params)
    expected = torch.cat([(p.detach() - 0.5 * g).reshape(-1) for p, g in zip(params, grads)])
    assert torch.allclose(personal, expected, atol=1e-6)
    assert torch.equal(method.personal_model(1, 2, glob), personal)  # seeded by (seed, round, client)


def test_the_same_batch_for_both_gradients_on_a_quadratic():
    """Updata.py L575 and L581 take both gradients on the same ``data, label``: D = D′. w = (1, 1), α = 0.1:
    ∇f_D(w) = (2 − 1, 1) = (1, 1), w̃ = (0.9, 0.9), ∇f_D(w̃) = (1.8 − 1, 0.9) = (0.8, 0.9); the plain step with
    β = 1e-3 (L583-585) gives w′ = (1 − 0.0008, 1 − 0.0009) = (0.9992, 0.9991)."""
    w = torch.tensor([1.0, 1.0], dtype=torch.float64, requires_grad=True)
    g, _ = meta_gradient([w], quadratic(w), [0, 0], alpha=0.1, variant="fo", delta=1e-3)
    assert torch.allclose(g[0], torch.tensor([0.8, 0.9], dtype=torch.float64), atol=1e-12)
    assert torch.allclose(w.detach() - 1e-3 * g[0], torch.tensor([0.9992, 0.9991], dtype=torch.float64), atol=1e-12)


def test_fit_takes_the_released_plain_step_on_one_batch_whatever_the_runs_optimiser(tmp_path):
    """The default (released): w ← w − 0.001 · ∇f(w − α∇f(w; D); D) per batch, one batch a step, so an epoch
    is one pass over the client's data in ⌈n / B⌉ steps; the run's Adam (FedDW's for the other rows) is not
    used (Updata.py L561 comments it out)."""
    train = {"optimizer": "adam", "lr": 0.5, "weight_decay": 0.0, "epochs": 1}
    ctx, method = opened(tmp_path, {"name": "perfedavg", "alpha": 0.05}, train=train)
    assert (method.params.beta, method.params.beta_step, method.params.batches) == (0.001, "sgd", "same")
    start = ctx.initial_weights.clone()
    client_round(ctx, method, 0, 1, start)
    after = ctx.layout.flatten(ctx.model)
    data = ctx.data.client(0)
    steps = -(-len(data) // ctx.config.train.batch_size)
    # Redo every step by hand from the same client stream.
    ctx.layout.load(ctx.model, start)
    stream = batch_stream(data.indices, ctx.config.train.batch_size, torch_generator(ctx.config.seed, "client", 1, 0))
    params = list(ctx.model.parameters())
    for _ in range(steps):
        b, _ = next(stream)
        g, _ = meta_gradient(params, lambda b: F.cross_entropy(ctx.model(data.x[b]), data.y[b]), [b, b], 0.05, "fo",
                             1e-3)
        with torch.no_grad():
            for p, gi in zip(params, g):
                p.sub_(0.001 * gi)
    assert torch.allclose(after, ctx.layout.flatten(ctx.model), atol=1e-6)
    assert steps > 1  # the step count is checked too: one step more or less would not match


def test_feddws_preset_is_the_released_form():
    from fedguide.methods.personalised.perfedavg import PerFedAvgParams
    p = PerFedAvgParams(protocol="feddw", beta_step="optimizer", batches="independent")
    assert (p.variant, p.alpha, p.beta) == ("fo", 0.01, 0.001)  # config.py alpha=1e-2, beta=1e-3
    assert (p.beta_step, p.batches) == ("optimizer", "independent")  # options given explicitly win


def test_a_stream_takes_each_pass_where_the_tensors_are_kept_once():
    """With ``keep`` (DeviceData.indices) a pass's order is mapped once and each batch is its slice: the same
    indices as the host batch, so a step copies nothing."""
    calls = []

    def keep(order):
        calls.append(order.clone())
        return order + 100

    stream = batch_stream(torch.arange(5), 2, torch.Generator().manual_seed(0), keep=keep)
    seen = [next(stream) for _ in range(6)]  # two passes of 2 + 2 + 1
    assert len(calls) == 2
    for host, kept in seen:
        assert torch.equal(kept, host + 100)
    assert [len(h) for h, _ in seen] == [2, 2, 1, 2, 2, 1]
    assert next(batch_stream(torch.arange(5), 2, torch.Generator()))[1] is None
