"""FedDF as a one-shot baseline: the ensemble target, distillation on the public pool from the clients'
FedAvg, heterogeneous clients, and the error without a public pool."""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from fedguide.methods.feddf import FedDF
from fedguide.methods._distill import distillation_loss, fit, mean_logit_targets
from fedguide.config import build_config
from fedguide.core.aggregation import sample_weighted_average
from fedguide.core.weights import WeightLayout
from fedguide.models import MODELS, ModelSpec, build_model
from fedguide.registry import ConfigError
from tiny import BASE, run_tiny


def raw_config(method: dict, public_fraction: float = 0.1) -> dict:
    raw = copy.deepcopy(BASE)
    raw.update({
        "data": {"name": "digits_domains", "image_size": 8, "per_class": 4, "fraction": 0.3,
                 "public_fraction": public_fraction},
        "partition": {"name": "disjoint_classes", "k": 2},
        "model": {"name": "mlp", "hidden": 32},
        "clients": {"num": 2, "per_round": 2},
        "train": {"rounds": 1, "epochs": 1, "batch_size": 32, "lr": 0.05},
        "method": {"name": "feddf", "local_epochs": 2, "distill_steps": 5, "progress": False, **method},
    })
    return raw


def test_ensemble_target_is_the_softmax_of_the_averaged_logits():
    a, b = torch.tensor([[0.0, 0.0]]), torch.tensor([[2.0, 0.0]])
    target = mean_logit_targets([a, b])
    assert target[0, 0].item() == pytest.approx(1 / (1 + math.exp(-1)), rel=1e-6)  # softmax(1, 0)
    # averaged logits, not averaged probabilities: (0.5 + 0.881) / 2 would be 0.690
    assert target[0, 0].item() != pytest.approx((0.5 + 1 / (1 + math.exp(-2))) / 2, rel=1e-3)
    assert mean_logit_targets([b], temperature=2.0)[0, 0].item() == pytest.approx(1 / (1 + math.exp(-1)), rel=1e-6)


def test_distillation_moves_the_student_to_the_ensemble():
    torch.manual_seed(0)
    spec = ModelSpec((1, 4, 4), 3)
    student = build_model("mlp", MODELS.parse_params("mlp", {"hidden": 16}, "m"), spec)
    x = torch.randn(64, 1, 4, 4)
    targets = F.softmax(torch.randn(64, 3) * 3, dim=1)
    before = distillation_loss(student(x), targets).item()
    fit(student, 64, lambda m, idx: distillation_loss(m(x[idx]), targets[idx]),
        torch.optim.Adam(student.parameters(), lr=1e-2), 16, torch.Generator().manual_seed(0), steps=60)
    with torch.no_grad():
        after = distillation_loss(student(x), targets).item()
    assert after < 0.5 * before


def test_no_public_pool_is_an_error_naming_the_fix(tmp_path):
    with pytest.raises(ConfigError, match="data.public_fraction"):
        run_tiny(tmp_path, build_config(raw_config({}, public_fraction=0.0)))


def test_student_starts_from_the_clients_fedavg(tmp_path, monkeypatch):
    seen = {}
    real = FedDF.one_shot

    def spy(self, uploads):
        seen["uploads"] = uploads
        return real(self, uploads)

    monkeypatch.setattr(FedDF, "one_shot", spy)
    # a vanishing learning rate: the distilled model is its starting point
    summary, rows, run_dir = run_tiny(tmp_path, build_config(raw_config({"distill_lr": 1e-12})))
    uploads = seen["uploads"]
    expected = sample_weighted_average([u["weights"] for u in uploads], [u["num_samples"] for u in uploads])
    model = build_model("mlp", MODELS.parse_params("mlp", {"hidden": 32}, "m"), ModelSpec((3, 8, 8), 10))
    model.load_state_dict(load_file(run_dir / "model.safetensors"))
    torch.testing.assert_close(WeightLayout.of(model).flatten(model), expected, atol=1e-6, rtol=0)
    m = rows[0]
    assert m["fedavg_start_clients"] == 2 and m["public_images"] > 0 and m["bytes_down"] == 0
    assert set(m["client_class_accuracy"]) == {"0", "1"} and 0 <= m["client_models_accuracy_mean"] <= 1


def test_heterogeneous_clients_distil_into_the_global_architecture(tmp_path):
    models = [{"name": "mlp", "hidden": 32}, {"name": "resnet10", "width": 2}]  # client 0 has the global architecture
    summary, rows, _ = run_tiny(tmp_path, build_config(raw_config({"client_models": models})))
    assert rows[0]["fedavg_start_clients"] == 1 and math.isfinite(rows[0]["distillation_loss"])
    assert summary["model"] == "mlp"
