"""pFedMe against its official code (CharlieDinh/pFedMe): the inner θ step
θ ← θ − η_p·(∇f(θ) + λ·(θ − w) + μ·θ) (FLAlgorithms/optimizers/fedoptimizer.py L57-65), the local update
w ← w − η·λ·(w − θ) (FLAlgorithms/users/userpFedMe.py L53-54), the client's loop of R local steps of K inner steps
on one batch (userpFedMe.py L36-58) and the server's β-mixing of the sample-weighted average
(FLAlgorithms/servers/serverbase.py L107-125); then end to end on 8x8 digits and an exact resume."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fedguide.core.seeding import torch_generator
from fedguide.methods.personalised.pfedme import inner_step_, local_update_, server_mix
from tests.methods.pfl_cases import client_round, opened
from tests.tiny import run_tiny, tiny_config, without_timing


def test_the_inner_step_is_the_official_rule_on_hand_computed_numbers():
    # θ = (1, −1), w = (0.5, 0.5), ∇f(θ) = (0.2, −0.4), λ 15, η_p 0.09, μ 0.001:
    # ∇f + λ(θ − w) + μθ = (0.2 + 7.5 + 0.001, −0.4 − 22.5 − 0.001) = (7.701, −22.901)
    # θ − η_p·that = (1 − 0.69309, −1 + 2.06109) = (0.30691, 1.06109)          (fedoptimizer.py L64)
    theta = [torch.tensor([1.0, -1.0])]
    inner_step_(theta, [torch.tensor([0.2, -0.4])], [torch.tensor([0.5, 0.5])], personal_lr=0.09, lam=15.0, mu=0.001)
    assert torch.allclose(theta[0], torch.tensor([0.30691, 1.06109]), atol=1e-6)


def test_the_local_update_is_the_official_rule_on_hand_computed_numbers():
    # w = (0.5, 0.5), θ = (0.30691, 1.06109), η 0.005, λ 15 (ηλ = 0.075):
    # w − 0.075·(w − θ) = (0.5 − 0.075·0.19309, 0.5 + 0.075·0.56109) = (0.48551825, 0.54208175)   (L53-54)
    w = [torch.tensor([0.5, 0.5])]
    local_update_(w, [torch.tensor([0.30691, 1.06109])], lr=0.005, lam=15.0)
    assert torch.allclose(w[0], torch.tensor([0.48551825, 0.54208175]), atol=1e-7)


def test_the_server_mixes_the_previous_model_with_the_average():
    # x = (1, 2), average (3, 6): β 1 → the average; β 2 (the README's tuned runs) → −x + 2·avg = (5, 10);
    # β 0.5 → (2, 4)                                                              (serverbase.py L124-125)
    x, avg = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 6.0])
    assert server_mix(x, avg, 1.0).tolist() == [3.0, 6.0]
    assert server_mix(x, avg, 2.0).tolist() == [5.0, 10.0]
    assert server_mix(x, avg, 0.5).tolist() == [2.0, 4.0]


def test_aggregate_weights_the_uploads_by_client_size_then_mixes(tmp_path):
    # serverbase.py L116-120: n_i / Σn over the round's clients: (1·1 + 3·3)/4 = 2.5; β 0.5 with x = 0: 1.25.
    ctx, method = opened(tmp_path, {"name": "pfedme", "beta": 0.5})
    n = ctx.layout.numel
    out = method.aggregate(1, torch.zeros(n), [{"weights": torch.ones(n), "num_samples": 1},
                                               {"weights": 3 * torch.ones(n), "num_samples": 3}])
    assert torch.allclose(out, torch.full((n,), 1.25))


def _reference_round(model, data, batches, lr, personal_lr, lam, mu, k):
    """userpFedMe.train and pFedMeOptimizer.step, literally: θ is the model's parameters, w the local copy."""
    params = list(model.parameters())
    local = [p.detach().clone() for p in params]
    for b in batches:
        x, y = data.x[b], data.y[b]
        for _ in range(k):
            for p in params:
                p.grad = None
            F.cross_entropy(model(x), y).backward()
            for p, lw in zip(params, local):
                p.data = p.data - personal_lr * (p.grad.data + lam * (p.data - lw.data) + mu * p.data)
        for new, lw in zip(params, local):
            lw.data = lw.data - lam * lr * (lw.data - new.data)
    return [p.detach().clone() for p in params], local


def _batches(data, batch_size, generator, steps):
    out = []
    while len(out) < steps:
        order = data.indices[torch.randperm(len(data), generator=generator)]
        out += [order[s: s + batch_size] for s in range(0, len(order), batch_size)][: steps - len(out)]
    return out


@pytest.mark.parametrize("personal", ["theta", "local"])
def test_a_clients_round_is_the_official_loop(tmp_path, personal):
    method = {"name": "pfedme", "lam": 15.0, "inner_steps": 3, "personal_lr": 0.05, "mu": 0.001,
              "personal": personal}
    ctx, m = opened(tmp_path, method, train={"local_steps": 4, "lr": 0.01})
    torch.manual_seed(0)
    w_t = ctx.initial_weights + 0.05 * torch.randn_like(ctx.initial_weights)
    upload, res = client_round(ctx, m, 1, 1, w_t)
    kept = ctx.store.get(1, 1)["personal"]

    model, data = ctx.model, ctx.data.client(1)
    ctx.layout.load(model, w_t)
    batches = _batches(data, 32, torch_generator(ctx.config.seed, "client", 1, 1), 4)
    theta, w = _reference_round(model, data, batches, lr=0.01, personal_lr=0.05, lam=15.0, mu=0.001, k=3)
    ctx.layout.load(model, upload["weights"])  # the client uploads w (userpFedMe.py L58)
    assert all(torch.allclose(p, wi, atol=1e-6) for p, wi in zip(model.parameters(), w))
    ctx.layout.load(model, kept)
    assert all(torch.allclose(p, expected, atol=1e-6) for p, expected in zip(model.parameters(),
                                                                              theta if personal == "theta" else w))
    assert res.loss is not None and res.loss > 0


def test_a_client_that_has_not_trained_has_the_global_model(tmp_path):
    ctx, method = opened(tmp_path, {"name": "pfedme"})
    glob = ctx.initial_weights + 1.0
    assert torch.equal(method.personal_model(1, 0, glob), glob)
    client_round(ctx, method, 0, 1, glob)
    assert torch.equal(method.personal_model(1, 0, glob), ctx.store.get(0, 1)["personal"])


def test_pfedme_learns_and_scores_the_server_model_when_asked(tmp_path):
    over = dict(train={"rounds": 3, "epochs": 2}, eval={"mode": "both"})
    _, rows, _ = run_tiny(tmp_path, tiny_config(method={"name": "pfedme"}, **over), "clients")
    _, srows, _ = run_tiny(tmp_path, tiny_config(method={"name": "pfedme", "global_eval": "server"}, **over), "server")
    assert rows[-1]["personal_accuracy"] > 0.4, rows[-1]  # chance is 0.1
    assert [r["personal_accuracy"] for r in srows] == [r["personal_accuracy"] for r in rows]
    assert [r["accuracy"] for r in srows] != [r["accuracy"] for r in rows]
    assert srows[-1]["accuracy"] > srows[0]["accuracy"]


def test_pfedme_resumes_to_the_uninterrupted_result(tmp_path):
    cfg = dict(method={"name": "pfedme"}, eval={"mode": "both"})
    _, full, _ = run_tiny(tmp_path, tiny_config(train={"rounds": 3}, **cfg), "full")
    run_tiny(tmp_path, tiny_config(train={"rounds": 2}, **cfg), "cut")
    _, resumed, _ = run_tiny(tmp_path, tiny_config(train={"rounds": 3}, **cfg), "cut", resume=True)
    assert without_timing(resumed) == without_timing(full)
