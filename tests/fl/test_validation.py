"""The validation split (data.val_fraction, data.val_from): what it holds out, its accuracy every round, the round
it picks (summary.json and report's "acc at best val"), early stopping on it, and the methods it cannot score."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from fedguide.core.seeding import numpy_rng
from fedguide.data.federated import validation_part
from fedguide.fl.engine import Experiment
from fedguide.fl.setup import prepare
from fedguide.registry import ConfigError
from fedguide.report.measures import measure
from fedguide.report.runs import load_runs
from fedguide.report.tables import results_table
from tests.tiny import tiny_config


def test_each_class_gives_its_share_rounded_half_up_and_keeps_one_sample():
    labels = np.array([0, 0, 0, 0, 1, 1, 2, 3, 3, 3])
    held = validation_part(labels, 0.5, numpy_rng(0, "validation"))
    # class 0: 2 of 4; class 1: 1 of 2; class 2: its one sample stays for training; class 3: round(1.5) = 2 of 3
    assert np.bincount(labels[held], minlength=4).tolist() == [2, 1, 0, 2]
    assert len(set(held.tolist())) == len(held)


def cfg(val=0.2, val_from="server", rounds=3, method="fedavg", **over):
    return tiny_config({"data": {"val_fraction": val, "val_from": val_from}, "method": {"name": method},
                        "clients": {"num": 4, "per_round": 4}, "train": {"rounds": rounds}, "seed": 3}, **over)


@pytest.mark.parametrize("val_from", ["server", "clients"])
def test_the_split_is_held_out_from_every_client_and_seeded(val_from):
    plain, held = prepare(cfg(0.0)).data, prepare(cfg(0.2, val_from)).data
    val = held.val_indices
    train = np.concatenate(held.client_indices)
    assert plain.val_indices is None and len(np.intersect1d(val, train)) == 0
    # The validation samples come out of the data the run would otherwise train on.
    assert sorted(np.concatenate([val, train]).tolist()) == sorted(np.concatenate(plain.client_indices).tolist())
    assert len(val) == pytest.approx(0.2 * len(np.concatenate(plain.client_indices)), rel=0.1)
    assert np.array_equal(prepare(cfg(0.2, val_from)).data.val_indices, val)
    if val_from == "clients":  # each client's share comes from its own data
        for before, after in zip(plain.client_indices, held.client_indices):
            assert set(after) <= set(before) and len(after) < len(before)


def test_every_round_scores_the_split_and_the_summary_names_the_round_it_picks(tmp_path):
    summary = Experiment(prepare(cfg(rounds=4)), tmp_path / "run", log=lambda s: None).run()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    vals = [r["val_accuracy"] for r in rows]
    picked = vals.index(max(vals))
    assert summary["best_val_round"] == picked + 1 and summary["best_val_accuracy"] == max(vals)
    assert summary["accuracy_at_best_val"] == rows[picked]["accuracy"]
    assert summary["final_val_accuracy"] == vals[-1]
    # The last round's validation accuracy is the final model's on the held-out training samples.
    from safetensors.torch import load_file

    prepared = prepare(cfg(rounds=4))
    from fedguide.fl.setup import open_run

    ctx, _ = open_run(prepared, tmp_path / "probe")
    ctx.model.load_state_dict(load_file(tmp_path / "run" / "model.safetensors"))
    ctx.model.eval()
    idx = torch.from_numpy(prepared.data.val_indices)
    with torch.no_grad():
        hits = (ctx.model(prepared.data.splits.train_x[idx]).argmax(1) == prepared.data.splits.train_y[idx]).double()
    assert vals[-1] == pytest.approx(float(hits.mean()))
    partition = json.loads((tmp_path / "run" / "partition.json").read_text())
    assert partition["val_samples"] == len(prepared.data.val_indices)
    run = load_runs([tmp_path / "run"])[0]
    assert measure(run, "best_val", 2) == rows[picked]["accuracy"]
    assert "acc at best val" in results_table([tmp_path / "run"])


def test_a_personalised_method_is_scored_on_the_split_with_its_clients_models(tmp_path):
    summary = Experiment(prepare(cfg(method="fedper")), tmp_path / "run", log=lambda s: None).run()
    assert 0.0 < summary["final_val_accuracy"] <= 1.0


def test_early_stopping_ends_the_run_when_validation_stops_improving(tmp_path):
    summary = Experiment(prepare(cfg(rounds=12, eval={"early_stop": 1}, train={"rounds": 12, "epochs": 1,
                                                                                "batch_size": 32, "lr": 0.5})),
                         tmp_path / "run", log=lambda s: None).run()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) < 12 and summary["stopped_early"] == {"after_round": len(rows), "patience": 1}
    assert rows[-1]["val_accuracy"] <= rows[-2]["val_accuracy"]  # the round that did not improve
    assert summary["accuracy_curve"] == [r["accuracy"] for r in rows]


def test_early_stopping_without_a_split_is_refused():
    with pytest.raises(ConfigError, match="set data.val_fraction"):
        cfg(0.0, eval={"early_stop": 2})


def test_a_method_scoring_without_the_runs_evaluator_is_refused(tmp_path, monkeypatch):
    from fedguide.methods.classic.fedavg import FedAvg

    monkeypatch.setattr(FedAvg, "evaluate", lambda self, round_, w: {"accuracy": 0.5})
    with pytest.raises(ConfigError, match="cannot be scored on a validation split; remove data.val_fraction"):
        Experiment(prepare(cfg()), tmp_path / "run", log=lambda s: None).run()
