"""The linear probe of the self-supervised methods against FedEMA's released evaluation (EasyFL
applications/fedssl/linear_evaluation.py, lines 118-159: nn.Linear(d, classes), Adam lr 3e-3, 200 epochs,
batches of 2048 in a fixed order, cross-entropy), and the scikit-learn probe kept as ``probe: sklearn``."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fedguide.methods._linear_probe import ProbeParams, released_probe


def test_one_adam_step_moves_every_weight_by_lr_against_its_gradients_sign():
    # Adam's first step is lr * m1_hat / (sqrt(v1_hat) + eps) = lr * g / (|g| + eps) = lr * sign(g) for g != 0.
    x = torch.tensor([[1.0, 0.0], [0.0, 2.0], [1.0, 1.0]])
    y = torch.tensor([0, 1, 1])
    torch.manual_seed(7)
    w0 = torch.nn.Linear(2, 2)
    logits = x @ w0.weight.detach().T + w0.bias.detach()
    g = (F.softmax(logits, 1) - F.one_hot(y, 2)) / 3  # dL/dlogits of the mean cross-entropy
    w1, b1 = w0.weight.detach() - 0.1 * torch.sign(g.T @ x), w0.bias.detach() - 0.1 * torch.sign(g.sum(0))
    expected = ((x @ w1.T + b1).argmax(1) == y).float().mean().item()
    assert released_probe(x, y, x, y, 2, epochs=1, lr=0.1, batch=2048, seed=7) == pytest.approx(expected)


def test_the_probe_separates_separable_features_and_leaves_the_callers_random_streams_alone():
    gen = torch.Generator().manual_seed(0)
    y = torch.arange(200) % 4
    x = F.one_hot(y, 4).float() * 3 + 0.3 * torch.randn(200, 4, generator=gen)
    state = torch.get_rng_state()
    acc = released_probe(x[:150], y[:150], x[150:], y[150:], 4, epochs=50, lr=3e-3 * 10, batch=64, seed=1)
    assert torch.equal(torch.get_rng_state(), state)
    assert acc == 1.0
    assert released_probe(x[:150], y[:150], x[150:], y[150:], 4, epochs=50, lr=3e-2, batch=64, seed=1) == acc


def test_the_released_settings_are_the_defaults():
    p = ProbeParams()
    assert (p.probe, p.probe_samples, p.probe_epochs, p.probe_lr, p.probe_batch) == ("released", None, 200, 3e-3, 2048)


@pytest.mark.parametrize("probe", ["released", "sklearn"])
def test_fedema_scores_its_encoder_with_either_probe_on_every_training_sample(tmp_path, probe, monkeypatch):
    from fedguide.config import build_config
    from fedguide.fl.engine import Experiment
    from fedguide.fl.setup import prepare
    from fedguide.methods import _linear_probe

    pools = []
    real = _linear_probe.LinearProbe._pool

    def spy(self):
        pools.append(real(self))
        return pools[-1]

    monkeypatch.setattr(_linear_probe.LinearProbe, "_pool", spy)
    cfg = build_config({"data": {"name": "digits"}, "partition": {"name": "dirichlet", "alpha": 0.5, "min_size": 5},
                        "model": {"name": "mlp"},
                        "method": {"name": "fedema", "hidden_dim": 16, "projection_dim": 8, "flip": False,
                                   "probe": probe, "probe_epochs": 20},
                        "clients": {"num": 3, "per_round": 3},
                        "train": {"rounds": 1, "epochs": 1, "batch_size": 32, "lr": 0.05},
                        "runtime": {"workers": 1, "threads_per_worker": 1}, "seed": 0})
    prepared = prepare(cfg)
    summary = Experiment(prepared, tmp_path / "run", log=lambda s: None).run()
    union = set().union(*(set(i.tolist()) for i in prepared.data.client_indices))
    assert set(pools[-1].tolist()) == union
    assert 0.1 < summary["final_accuracy"] <= 1.0
