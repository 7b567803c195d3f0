"""eval.client_classes: the server's model scored on the test samples of each client's classes (FedCADO
Table 2's per-client columns), for every method that scores through the evaluator."""
import json

import pytest
import torch
from safetensors.torch import load_file

from fedguide.config import build_config
from fedguide.core.evaluation import class_set_accuracy, mean_metrics
from fedguide.fl.setup import open_run, prepare
from tests.tiny import run_tiny, tiny_config, tiny_raw


def disjoint(**over):
    """The tiny run with two classes per client, none shared, scoring each client's classes."""
    raw = tiny_raw({"eval": {"client_classes": True}}, **over)
    raw["partition"] = {"name": "disjoint_classes", "k": 2}
    return build_config(raw)


def test_class_set_accuracy_on_hand_computed_predictions():
    labels = torch.tensor([0, 0, 1, 1, 2, 3])
    correct = torch.tensor([True, False, True, True, False, True])
    # client 0 holds {0, 1}: 3 of 4 right; client 1 holds {2}: 0 of 1; client 2's class 5 has no test sample.
    assert class_set_accuracy(correct, labels, {0: [0, 1], 1: [2], 2: [5]}) == {"0": 0.75, "1": 0.0}


def test_per_model_means_average_the_per_client_columns():
    out = mean_metrics([{"accuracy": 0.5, "client_class_accuracy": {"0": 0.2, "1": 1.0}},
                        {"accuracy": 0.7, "client_class_accuracy": {"0": 0.4, "1": 0.0}}])
    assert out["client_class_accuracy"] == pytest.approx({"0": 0.3, "1": 0.5})


def test_every_round_scores_each_clients_classes_with_the_final_model(tmp_path):
    cfg = disjoint()
    summary, rows, run_dir = run_tiny(tmp_path, cfg)
    partition = json.loads((run_dir / "partition.json").read_text())
    held = {str(c): [k for k, n in enumerate(counts) if n] for c, counts in enumerate(partition["counts"])}
    assert all(set(r["client_class_accuracy"]) == set(held) for r in rows)
    assert summary["client_class_accuracy"] == rows[-1]["client_class_accuracy"]
    ctx, _ = open_run(prepare(cfg), tmp_path / "check")
    ctx.model.load_state_dict(load_file(run_dir / "model.safetensors"))
    ctx.model.eval()
    with torch.no_grad():
        predictions = ctx.model(ctx.evaluator.x).argmax(1)
    y = ctx.evaluator.y
    for cid, classes in held.items():
        mask = torch.isin(y, torch.tensor(classes))
        expected = float((predictions[mask] == y[mask]).double().mean())
        assert summary["client_class_accuracy"][cid] == pytest.approx(expected)


def test_the_ceiling_keeps_the_partitions_clients_though_it_trains_as_one(tmp_path):
    summary, _, _ = run_tiny(tmp_path, disjoint(method={"name": "centralized"}, train={"rounds": 1}))
    assert set(summary["client_class_accuracy"]) == {"0", "1", "2", "3"}


def test_off_by_default(tmp_path):
    summary, rows, _ = run_tiny(tmp_path, tiny_config(train={"rounds": 1}))
    assert "client_class_accuracy" not in rows[-1] and "client_class_accuracy" not in summary
