"""FedDISC with ``head: model``: the run's own model (FedDifRC's Table 6 trains ResNet-10 for every row,
FedDifRC Sec. 5.1; hwang52/FedDifRC model/resnet_cnn.py:118) trained on FedDISC's generated images at the
dataset's input size, scored by the engine's evaluator, surviving a resume (its smoke run on the embedded models
is test_feddisc.py's, beside the paper's and the released schedule's, sharing their embedded images)."""
from __future__ import annotations

import json
import math

import pytest
import torch

from fedguide.methods.frozen_encoder.centroids.feddisc import FedDISC
from tests.tiny import Crash, crash_after, run_tiny

pytestmark = pytest.mark.usefixtures("cached_digits")
FAST = {"num_centroids": 2, "images_per_centroid": 2, "steps": 2, "sample_grid": 0}


def test_the_runs_model_is_trained_on_the_generated_images_and_scored(digits_config, tmp_path, monkeypatch):
    seen = {}
    train, evaluate = FedDISC.train_model, FedDISC.evaluate

    def spy_train(self, stored, labels):
        seen.update(stored=stored, labels=labels, initial=self.run.initial_weights.clone(),
                    input_shape=tuple(self.run.data.splits.input_shape))
        seen["trained"], loss = train(self, stored, labels)
        return seen["trained"], loss

    def spy_evaluate(self, round_, global_weights):
        seen.setdefault("evaluated", []).append(global_weights.clone())
        return evaluate(self, round_, global_weights)

    monkeypatch.setattr(FedDISC, "train_model", spy_train)
    monkeypatch.setattr(FedDISC, "evaluate", spy_evaluate)
    cfg = digits_config({"name": "feddisc", **FAST, "head": "model", "model_epochs": 2}, rounds=2)
    with pytest.raises(Crash):
        run_tiny(tmp_path, cfg, log=crash_after(1))
    first = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    # the images reach the model as the dataset's own: 8-bit, its channels and size, one per generated image
    assert seen["stored"].dtype == torch.uint8 and tuple(seen["stored"].shape[1:]) == seen["input_shape"]
    assert len(seen["stored"]) == len(seen["labels"]) == first["generated_images"] == first["model_train_samples"]
    assert "head_train_loss" not in first and math.isfinite(first["model_train_loss"])
    # the global model is the trained one (not the initial weights), and it is what is scored
    assert not torch.equal(seen["trained"].cpu(), seen["initial"].cpu())
    assert torch.equal(seen["evaluated"][0].cpu(), seen["trained"].cpu())
    assert 0.0 <= first["accuracy"] <= 1.0 and len(first["class_accuracy"]) == 10 and "privacy" in first
    # resumed after round 1: the model is not trained again, round 2 scores the same weights
    calls = len(seen["evaluated"])
    _, rows, _ = run_tiny(tmp_path, cfg, resume=True)
    assert len(rows) == 2 and rows[1]["accuracy"] == rows[0]["accuracy"]
    assert torch.equal(seen["evaluated"][calls].cpu(), seen["trained"].cpu())
