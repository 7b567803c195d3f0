"""FedDyn against the authors' code (alpemreacar/FedDyn): the client's linear + quadratic term
α_k·⟨θ, −x + l_k⟩ with weight decay α_k (utils_general.py L190, L219), its gradient clipping (L224), the adaptive
α_k = α / (n_k·N/Σn) (utils_methods.py L296-297, L387), the client's state l_k += θ_k − x (L393) and the server's
x = mean of the round's models + mean over all clients of l_k (L396-397), i.e. h ← h − α·(1/m)·Σ(θ_k − x) and
x = average − h/α; then end to end on 8x8 digits and an exact resume."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedguide.core.seeding import torch_generator
from fedguide.core.state import ClientStateStore
from fedguide.fl.checkpoint import load_checkpoint
from fedguide.fl.setup import prepare
from fedguide.methods.classic.feddyn import (DynRound, FedDyn, FedDynParams, client_alpha, clip_by_total_norm_,
                                             gradient_state_update, next_model, server_update)
from tests.methods.pfl_cases import client_round, opened
from tests.tiny import run_tiny, tiny_config, without_timing


def test_client_alpha_is_scaled_by_the_clients_share():
    # sizes 10 and 30: N = 2, Σn = 40, weight_list = n·N/Σn = (0.5, 1.5); α_k = α / weight (L297, L387)
    assert client_alpha(0.01, [10, 30], 0, "samples") == pytest.approx(0.02)
    assert client_alpha(0.01, [10, 30], 1, "samples") == pytest.approx(0.01 / 1.5)
    assert client_alpha(0.01, [10, 30], 1, "none") == 0.01


def _method(max_grad_norm):
    run = SimpleNamespace(data=SimpleNamespace(client_indices=[np.arange(2)]))
    return FedDyn(FedDynParams(max_grad_norm=max_grad_norm), run)


@pytest.mark.parametrize("max_grad_norm", [None, 10.0, 0.5])
def test_the_gradient_is_the_official_loss_algos_then_clipped_then_the_weight_decay(max_grad_norm):
    # θ = (1, 2), x = (0.5, 1), l_k = (−3, 6) (g_k = −α·l_k = (0.3, −0.6)), α 0.1, task gradient (0.2, 0.1).
    # The official step: backward of CE + α⟨θ, −x + l⟩ → (0.2, 0.1) + 0.1·(−3.5, 5) = (−0.15, 0.6) (L219);
    # clip to the norm (L224): ||(−0.15, 0.6)|| = 0.61847; then SGD's weight decay α·θ = (0.1, 0.2) (L190).
    theta = torch.tensor([1.0, 2.0], requires_grad=True)
    x, l_k, alpha = torch.tensor([0.5, 1.0]), torch.tensor([-3.0, 6.0]), 0.1
    official = theta.detach().clone().requires_grad_(True)
    ((torch.tensor([0.2, 0.1]) * official).sum() + alpha * (official * (-x + l_k)).sum()).backward()
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_([official], max_norm=max_grad_norm)
    expected = official.grad + alpha * official.detach()

    g_k = -alpha * l_k
    (torch.tensor([0.2, 0.1]) * theta).sum().backward()
    _method(max_grad_norm).after_backward(None, None, DynRound([theta], [-g_k - alpha * x], alpha))
    assert torch.allclose(theta.grad, expected, atol=1e-6)
    by_hand = {None: [-0.05, 0.8], 10.0: [-0.05, 0.8], 0.5: [-0.15 * 0.5 / 0.61847 + 0.1, 0.6 * 0.5 / 0.61847 + 0.2]}
    assert torch.allclose(theta.grad, torch.tensor(by_hand[max_grad_norm]), atol=1e-4)


def test_clipping_scales_only_above_the_norm():
    grads = [torch.tensor([3.0, 4.0]), torch.tensor([0.0])]
    clip_by_total_norm_(grads, 10.0)
    assert grads[0].tolist() == [3.0, 4.0]
    clip_by_total_norm_(grads, 1.0)
    assert torch.allclose(grads[0], torch.tensor([0.6, 0.8]), atol=1e-6)


def test_the_gradient_state_update_is_the_official_one_in_the_papers_units():
    # g = (0.3, −0.6, 0) on two parameters and a buffer, θ = (1.2, 0.8, 5), x = (1, 1, 2), α_k 0.1:
    # g − α_k·(θ − x) = (0.3 − 0.02, −0.6 + 0.02, 0), the buffer untouched.
    g, theta, x = torch.tensor([0.3, -0.6, 0.0]), torch.tensor([1.2, 0.8, 5.0]), torch.tensor([1.0, 1.0, 2.0])
    mask = torch.tensor([1.0, 1.0, 0.0])
    out = gradient_state_update(g, theta, x, 0.1, mask)
    assert torch.allclose(out, torch.tensor([0.28, -0.58, 0.0]))
    # The official state l_k += θ − x (L393) is the same state: g = −α_k·l.
    l_k = -g / 0.1
    assert torch.allclose(out[:2], -0.1 * (l_k + theta - x)[:2])


def test_the_server_update_on_hand_computed_numbers():
    # h = (0.1, 0, 0), x = (1, 1, 2), θ_1 = (1.2, 0.8, 4), θ_2 = (1.4, 1, 6), α 0.1, m = 4 clients:
    # Σ(θ_k − x) = (0.6, −0.2); h − α·(1/4)·that = (0.1 − 0.015, 0.005, 0) = (0.085, 0.005, 0);
    # average (1.3, 0.9, 5); x = average − h/α = (1.3 − 0.85, 0.9 − 0.05, 5) = (0.45, 0.85, 5).
    h, x = torch.tensor([0.1, 0.0, 0.0]), torch.tensor([1.0, 1.0, 2.0])
    thetas = [torch.tensor([1.2, 0.8, 4.0]), torch.tensor([1.4, 1.0, 6.0])]
    h_new, average = server_update(h, x, thetas, 0.1, 4, torch.tensor([1.0, 1.0, 0.0]))
    assert torch.allclose(h_new, torch.tensor([0.085, 0.005, 0.0]))
    assert torch.allclose(average, torch.tensor([1.3, 0.9, 5.0]))
    assert torch.allclose(next_model(average, h_new, 0.1), torch.tensor([0.45, 0.85, 5.0]))


def test_rounds_of_server_updates_match_the_official_cloud_model():
    # utils_methods.py L393-397 over four rounds of random client models, with partial participation:
    # cld = mean(θ over the round's clients) + mean over all clients of local_param_list.
    rng = np.random.default_rng(0)
    m, d, alpha = 5, 3, 0.05
    local_param_list = np.zeros((m, d))
    cld = rng.normal(size=d)
    h, x = torch.zeros(d, dtype=torch.float64), torch.tensor(cld)
    for _ in range(4):
        chosen = sorted(rng.choice(m, size=3, replace=False))
        thetas = {k: cld + rng.normal(size=d) for k in chosen}
        for k in chosen:
            local_param_list[k] += thetas[k] - cld
        cld = np.mean([thetas[k] for k in chosen], axis=0) + np.mean(local_param_list, axis=0)
        h, average = server_update(h, x, [torch.tensor(thetas[k]) for k in chosen], alpha, m,
                                   torch.ones(d, dtype=torch.float64))
        x = next_model(average, h, alpha)
        assert torch.allclose(x, torch.tensor(cld), atol=1e-12)


def test_a_clients_round_starts_from_x_and_keeps_its_gradient_state(tmp_path):
    ctx, method = opened(tmp_path, {"name": "feddyn", "alpha": 0.1}, train={"local_steps": 2})
    method.h = 0.01 * torch.ones_like(method.h) * method.mask
    glob = ctx.initial_weights.clone()
    payload = method.server_payload(1, 0, glob)
    assert torch.allclose(payload["weights"], glob - method.h / 0.1)  # average − h/α
    upload, _ = client_round(ctx, method, 0, 1, glob)
    alpha_k = client_alpha(0.1, [len(i) for i in ctx.data.client_indices], 0, "samples")
    g = ctx.store.get(0, 1)["grad"]
    assert torch.allclose(g, -alpha_k * method.mask * (upload["weights"] - payload["weights"]))
    assert torch.count_nonzero(g * (1 - method.mask)) == 0  # no state on buffers


def test_a_clients_training_is_the_official_train_feddyn_mdl(tmp_path):
    # utils_general.py L185-242 literally: SGD with weight decay α_k + weight_decay (L190), the loss
    # CE + α_k·Σ θ·(−x + l_k) over the parameters (L219), clipping to 10 (L224), on the client's batches; a client
    # with a gradient state from an earlier round (l_k = −g_k/α_k) and a server with h ≠ 0.
    ctx, method = opened(tmp_path, {"name": "feddyn", "alpha": 0.1},
                         train={"local_steps": 3, "lr": 0.1, "momentum": 0.0, "weight_decay": 1e-3})
    torch.manual_seed(0)
    method.h = 0.01 * torch.randn_like(method.h) * method.mask
    g_k = 0.05 * torch.randn_like(method.h) * method.mask
    ctx.store.put(0, 1, {"grad": g_k})
    ctx.store.commit(1)
    glob = ctx.initial_weights.clone()
    x = method.server_payload(2, 0, glob)["weights"]
    upload, _ = client_round(ctx, method, 0, 2, glob)

    alpha_k = client_alpha(0.1, [len(i) for i in ctx.data.client_indices], 0, "samples")
    model, data = ctx.model, ctx.data.client(0)
    ctx.layout.load(model, x)
    mask = method.mask.bool()
    x_par, l_k = x[mask], (-g_k / alpha_k)[mask]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, weight_decay=alpha_k + 1e-3)
    generator, steps = torch_generator(ctx.config.seed, "client", 2, 0), 0
    while steps < 3:
        order = data.indices[torch.randperm(len(data), generator=generator)]
        for s in range(0, len(order), 32):
            if steps == 3:
                break
            b = order[s: s + 32]
            flat = torch.cat([p.reshape(-1) for p in model.parameters()])
            loss = F.cross_entropy(model(data.x[b]), data.y[b]) + alpha_k * torch.sum(flat * (-x_par + l_k))
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=10)
            optimizer.step()
            steps += 1
    assert torch.allclose(upload["weights"], ctx.layout.flatten(model), atol=1e-6)
    assert not torch.allclose(upload["weights"], x, atol=1e-3)


def test_the_servers_h_is_the_clients_gradient_states_summed(tmp_path):
    # Every client's g_k = −α_k·Σ(θ_k − x) and h = −α·(1/m)·Σ_all Σ(θ_k − x), so h = (α/m)·Σ_k g_k/α_k after any
    # number of rounds (utils_methods.py L393, L397).
    _, _, run_dir = run_tiny(tmp_path, tiny_config(method={"name": "feddyn"}, train={"rounds": 3}))
    sizes = [len(i) for i in prepare(tiny_config()).data.client_indices]
    h = load_checkpoint(run_dir / "checkpoints").method_state["h"]
    store = ClientStateStore(run_dir / "client_state")
    states = [store.get(k).get("grad") for k in range(len(sizes))]
    assert sum(g is not None for g in states) >= 2
    expected = sum(g / client_alpha(0.01, sizes, k, "samples") for k, g in enumerate(states) if g is not None)
    assert torch.allclose(h, 0.01 / len(sizes) * expected, atol=1e-7)
    assert torch.count_nonzero(h) > 0


def test_feddyn_learns_and_saves_the_evaluated_model(tmp_path):
    over = dict(train={"rounds": 3, "epochs": 2})
    avg, _, avg_dir = run_tiny(tmp_path, tiny_config(method={"name": "feddyn"}, **over), "average")
    srv, _, srv_dir = run_tiny(tmp_path, tiny_config(method={"name": "feddyn", "evaluate": "server"}, **over), "server")
    assert avg["final_accuracy"] > 0.4 and srv["final_accuracy"] > 0.4  # chance is 0.1
    # The clients see the same x either way; only what is tested and saved differs.
    a, s = (load_checkpoint(d / "checkpoints") for d in (avg_dir, srv_dir))
    assert torch.allclose(next_model(a.global_weights, a.method_state["h"], 0.01), s.global_weights, atol=1e-6)
    assert torch.allclose(a.method_state["h"], s.method_state["h"], atol=1e-7)


def test_a_checkpoint_without_h_is_refused(tmp_path):
    _, method = opened(tmp_path, {"name": "feddyn"})
    with pytest.raises(ValueError, match="no FedDyn server state h"):
        method.load_server_state({})


def test_feddyn_resumes_to_the_uninterrupted_result(tmp_path):
    _, full, _ = run_tiny(tmp_path, tiny_config(method={"name": "feddyn"}, train={"rounds": 3}), "full")
    run_tiny(tmp_path, tiny_config(method={"name": "feddyn"}, train={"rounds": 2}), "cut")
    _, resumed, _ = run_tiny(tmp_path, tiny_config(method={"name": "feddyn"}, train={"rounds": 3}), "cut",
                             resume=True)
    assert without_timing(resumed) == without_timing(full)
