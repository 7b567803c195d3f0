"""FedDF as a one-shot baseline: the ensemble target, distillation on the public pool from the clients'
FedAvg, heterogeneous clients, and the error without a public pool."""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from fedguide.methods.one_shot.feddf import FedDF, to_run_format
from fedguide.methods.one_shot._distill import distillation_loss, fit, mean_logit_targets
from fedguide.config import build_config
from fedguide.core.aggregation import sample_weighted_average
from fedguide.core.weights import WeightLayout
from fedguide.data.sources.base import DatasetSplits
from fedguide.fl.setup import open_run, prepare
from fedguide.models import MODELS, ModelSpec, build_model
from fedguide.registry import ConfigError
from tests.tiny import BASE, run_tiny


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


# ---- the public pool ---------------------------------------------------------------------------------------
def image_folder(root, classes=("ant", "bee"), per_class=3, size=12):
    """root/<class>/*.png: flat colour images, class k's red channel 40 + 80k."""
    from PIL import Image

    for k, name in enumerate(classes):
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            Image.new("RGB", (size, size), (40 + 80 * k, 10 * i, 200)).save(root / name / f"{i}.png")
    return root


def public(root, **extra):
    return {"public": {"source": "dataset", "name": "imagefolder", "root": str(root), "domain_level": False,
                       "test_fraction": 0.3, **extra}}


def test_pool_pixels_are_restandardised_for_the_run():
    pool = DatasetSplits(torch.full((1, 3, 2, 2), 1.0), torch.zeros(1, dtype=torch.long), torch.zeros(1, 3, 2, 2),
                         torch.zeros(1, dtype=torch.long), ["a"], pixel_stats=((0.5, 0.5, 0.2), (0.25, 0.25, 0.4)))
    # pool pixels: 0.5 + 0.25 = 0.75, 0.75, 0.2 + 0.4 = 0.6; grey run: mean 0.7, standardised (0.7 - 0.5) / 0.1
    grey = DatasetSplits(torch.zeros(1, 1, 2, 2), torch.zeros(1, dtype=torch.long), torch.zeros(1, 1, 2, 2),
                         torch.zeros(1, dtype=torch.long), ["a"], pixel_stats=(0.5, 0.1))
    torch.testing.assert_close(to_run_format(pool, grey, "p"), torch.full((1, 1, 2, 2), 2.0))
    rgb = DatasetSplits(torch.zeros(1, 3, 2, 2), torch.zeros(1, dtype=torch.long), torch.zeros(1, 3, 2, 2),
                        torch.zeros(1, dtype=torch.long), ["a"], pixel_stats=((0.75, 0.5, 0.6), (1.0, 0.5, 0.2)))
    torch.testing.assert_close(to_run_format(pool, rgb, "p")[0, :, 0, 0], torch.tensor([0.0, 0.5, 0.0]))
    small = DatasetSplits(torch.zeros(1, 3, 4, 4), torch.zeros(1, dtype=torch.long), torch.zeros(1, 3, 4, 4),
                          torch.zeros(1, dtype=torch.long), ["a"], pixel_stats=(0.5, 0.5))
    with pytest.raises(ConfigError, match="2x2 images, the model takes 4x4; set method.public.image_size: 4"):
        to_run_format(pool, small, "p")


def test_a_public_dataset_is_distilled_on_instead_of_a_split(tmp_path, monkeypatch):
    root = image_folder(tmp_path / "pool")
    seen = {}
    real = FedDF.public_inputs

    def spy(self):
        seen["x"] = real(self)
        return seen["x"]

    monkeypatch.setattr(FedDF, "public_inputs", spy)
    # no split is held out at all: the pool is the folder's 2 classes x 2 training images, at the run's 8x8
    summary, rows, _ = run_tiny(tmp_path, build_config(raw_config(public(root), public_fraction=0.0)))
    assert seen["x"].shape == (4, 3, 8, 8) and rows[0]["public_images"] == 4
    assert summary["method_params"]["public"]["name"] == "imagefolder"


def test_the_split_pool_is_labelled_in_the_summary(tmp_path):
    summary, _, _ = run_tiny(tmp_path, build_config(raw_config({})))
    assert summary["method_params"]["public"] == {"source": "split", "name": None}
    with pytest.raises(ConfigError, match="the keys root are for source: dataset"):
        prepare(build_config(raw_config({"public": {"root": "x"}})))


def test_a_pool_the_model_cannot_take_is_refused_before_training(tmp_path):
    root = image_folder(tmp_path / "pool")
    # at set-up (what --dry-run builds): images of another size
    with pytest.raises(ConfigError, match="image_size 16 gives 16x16 images, the model takes 8x8"):
        open_run(prepare(build_config(raw_config(public(root, image_size=16)))), tmp_path / "dry")
    # at load, before any client trains: a missing folder; scikit-learn's digits, which declare no pixel
    # statistics to convert with
    for name, method, message in (("a", public(tmp_path / "nowhere"), "method.public.root .* does not exist"),
                                  ("b", {"public": {"source": "dataset", "name": "digits"}}, "pixel statistics")):
        with pytest.raises(ConfigError, match=message):
            run_tiny(tmp_path, build_config(raw_config(method)), name=name)
        assert not list((tmp_path / name).glob("client_state/committed/*"))
