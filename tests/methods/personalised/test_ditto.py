"""Ditto against its official code (litian96/ditto, flearn/trainers_MTL/ditto.py): the personal step
v ← v − η·(∇F(v) + λ·(v − w^t)) (L116-118), the global step on the same batch (L121-125), the server's plain mean
of the updates (L129, L165, L168-169; fedbase.py L139-149), personal models initialised to the initial model
(fedbase.py L22-27); then end to end on 8x8 digits and an exact resume."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call

from fedguide.core.seeding import torch_generator
from fedguide.methods.personalised.ditto import personal_step_gradient_
from tests.methods.pfl_cases import client_round, opened
from tests.tiny import run_tiny, tiny_config, without_timing

PLAIN_SGD = {"momentum": 0.0, "weight_decay": 0.0}


def test_the_personal_step_is_the_official_rule_on_hand_computed_numbers():
    # v = (1, −2), w^t = (0.5, 0), ∇F(v) = (0.2, 0.4), λ = 1, η = 0.1:
    # ∇F + λ(v − w) = (0.2 + 0.5, 0.4 − 2) = (0.7, −1.6); v − η·that = (0.93, −1.84)   (ditto.py L117-118)
    v = torch.tensor([1.0, -2.0], requires_grad=True)
    anchor = [torch.tensor([0.5, 0.0])]
    opt = torch.optim.SGD([v], lr=0.1)
    (torch.tensor([0.2, 0.4]) * v).sum().backward()
    personal_step_gradient_([v], anchor, lam=1.0)
    opt.step()
    assert torch.allclose(v.detach(), torch.tensor([0.93, -1.84]))


def test_a_parameter_the_loss_missed_still_moves_towards_the_global_model():
    v = torch.tensor([3.0], requires_grad=True)
    personal_step_gradient_([v], [torch.tensor([1.0])], lam=0.5)
    assert v.grad.tolist() == [1.0]  # 0 + 0.5·(3 − 1)


def _reference_round(model, data, batches, v0, w0, lam, lr):
    """The official client loop, literally: per batch, v's step with the pull to w^t, then w_k's plain step."""
    names = [n for n, _ in model.named_parameters()]
    v = {n: t.clone() for n, t in zip(names, v0)}
    anchor = {n: t.clone() for n, t in zip(names, w0)}
    wk = {n: t.clone() for n, t in zip(names, w0)}
    for b in batches:
        x, y = data.x[b], data.y[b]
        for n in names:
            v[n].requires_grad_(True)
            wk[n].requires_grad_(True)
        gv = torch.autograd.grad(F.cross_entropy(functional_call(model, v, (x,)), y), [v[n] for n in names])
        v = {n: (v[n] - lr * (g + lam * (v[n] - anchor[n]))).detach() for n, g in zip(names, gv)}
        gw = torch.autograd.grad(F.cross_entropy(functional_call(model, wk, (x,)), y), [wk[n] for n in names])
        wk = {n: (wk[n] - lr * g).detach() for n, g in zip(names, gw)}
    return v, wk


def _batches(data, batch_size, generator, steps):
    out = []
    while len(out) < steps:
        order = data.indices[torch.randperm(len(data), generator=generator)]
        out += [order[s: s + batch_size] for s in range(0, len(order), batch_size)][: steps - len(out)]
    return out


def test_a_clients_round_is_the_official_interleaved_loop(tmp_path):
    # Plain SGD steps at one rate (GradientDescentOptimizer, L25), λ 0.5, a global model w^t the personal model
    # v (the initial one: the client has not trained yet) differs from.
    ctx, method = opened(tmp_path, {"name": "ditto", "lam": 0.5}, train={**PLAIN_SGD, "local_steps": 3, "lr": 0.1})
    torch.manual_seed(0)
    w_t = ctx.initial_weights + 0.05 * torch.randn_like(ctx.initial_weights)
    upload, _ = client_round(ctx, method, 1, 1, w_t)
    personal = ctx.store.get(1, 1)["personal"]

    model, data = ctx.model, ctx.data.client(1)
    batches = _batches(data, 32, torch_generator(ctx.config.seed, "client", 1, 1), 3)
    ctx.layout.load(model, ctx.initial_weights)
    v0 = [p.detach().clone() for p in model.parameters()]
    ctx.layout.load(model, w_t)
    w0 = [p.detach().clone() for p in model.parameters()]
    v, wk = _reference_round(model, data, batches, v0, w0, lam=0.5, lr=0.1)
    ctx.layout.load(model, personal)
    assert all(torch.allclose(p, v[n], atol=1e-6) for n, p in model.named_parameters())
    ctx.layout.load(model, upload["weights"])
    assert all(torch.allclose(p, wk[n], atol=1e-6) for n, p in model.named_parameters())
    assert not torch.allclose(personal, upload["weights"], atol=1e-3)  # two models, not one


@pytest.mark.parametrize("weighting, expected", [("uniform", [2.0, 4.0]), ("samples", [2.5, 5.0])])
def test_the_server_averages_the_updates(tmp_path, weighting, expected):
    # simple_average (fedbase.py L139-149): w + mean(w_k − w) = mean(w_k): (1 + 3)/2, (2 + 6)/2;
    # samples 1 and 3: (1 + 9)/4, (2 + 18)/4.
    ctx, method = opened(tmp_path, {"name": "ditto", "weighting": weighting})
    n = ctx.layout.numel
    a = torch.ones(n)
    a[1::2] = 2.0
    out = method.aggregate(1, torch.zeros(n), [{"weights": a, "num_samples": 1}, {"weights": 3 * a, "num_samples": 3}])
    assert out[:2].tolist() == expected


def test_a_client_that_has_not_trained_holds_the_initial_model_and_one_that_has_its_own(tmp_path):
    ctx, method = opened(tmp_path, {"name": "ditto"})
    glob = ctx.initial_weights + 1.0
    assert torch.equal(method.personal_model(1, 2, glob), ctx.initial_weights)  # fedbase.py L26-27
    client_round(ctx, method, 2, 1, glob)
    assert torch.equal(method.personal_model(1, 2, glob), ctx.store.get(2, 1)["personal"])


def test_the_global_model_is_fedavgs_and_the_personal_models_learn(tmp_path):
    # The global phase draws the batches FedAvg draws and the personal phase leaves the global model alone, so with
    # FedAvg's sample weights Ditto's global model is FedAvg's to the bit.
    over = dict(train={"rounds": 3, "epochs": 2}, eval={"mode": "both"})
    fedavg, _, _ = run_tiny(tmp_path, tiny_config(method={"name": "fedavg"}, **over), "fedavg")
    ditto, rows, _ = run_tiny(tmp_path, tiny_config(
        method={"name": "ditto", "weighting": "samples", "global_eval": "server"}, **over), "ditto")
    assert ditto["accuracy_curve"] == fedavg["accuracy_curve"]
    assert rows[-1]["personal_accuracy"] > 0.6, rows[-1]  # chance is 0.1
    clients, crows, _ = run_tiny(tmp_path, tiny_config(
        method={"name": "ditto", "weighting": "samples"}, **over), "clients")
    assert [r["personal_accuracy"] for r in crows] == [r["personal_accuracy"] for r in rows]
    assert clients["accuracy_curve"] != ditto["accuracy_curve"]  # the mean of the personal models, not the server's


def test_ditto_resumes_to_the_uninterrupted_result(tmp_path):
    cfg = dict(method={"name": "ditto"}, eval={"mode": "both"})
    _, full, _ = run_tiny(tmp_path, tiny_config(train={"rounds": 3}, **cfg), "full")
    run_tiny(tmp_path, tiny_config(train={"rounds": 2}, **cfg), "cut")
    _, resumed, _ = run_tiny(tmp_path, tiny_config(train={"rounds": 3}, **cfg), "cut", resume=True)
    assert without_timing(resumed) == without_timing(full)
