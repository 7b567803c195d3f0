"""Personalised evaluation (eval.mode): the clients' test splits, the personal metrics, and a tiny run on
every runtime with client state on disk."""
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from fedguide.core.evaluation import personal_metrics
from fedguide.data.federated import FederatedData, personal_test_splits, scored_test_subset
from fedguide.data.sources.base import DatasetSplits
from fedguide.fl.setup import prepare
from fedguide.registry import ConfigError
from tests.fl.runtimes.flower.loopback import simulation_without_ray
from tests.tiny import run_tiny, tiny_config, without_timing


def test_splits_follow_each_clients_training_mix_by_largest_remainders():
    # client 0 trains on 3 of class 0 and 1 of class 1, client 1 on 4 of class 1; 10 test samples per class.
    train = np.array([0, 0, 0, 1, 1, 1, 1, 1])
    clients = [np.array([0, 1, 2, 3]), np.array([4, 5, 6, 7])]
    test = np.repeat([0, 1], 10)
    full = personal_test_splits(train, clients, test, 1.0, np.random.default_rng(0))
    assert [np.bincount(test[s], minlength=2).tolist() for s in full] == [[10, 2], [0, 8]]  # class 1: 10·1/5, 10·4/5
    assert sorted(np.concatenate(full).tolist()) == list(range(20))  # every test sample, each to one client
    half = personal_test_splits(train, clients, test, 0.5, np.random.default_rng(0))
    assert [np.bincount(test[s], minlength=2).tolist() for s in half] == [[5, 1], [0, 4]]
    # Quotas 1.5 and 1.5 of 3 samples: the tie goes to the lower client.
    tie = personal_test_splits(np.array([0, 0]), [np.array([0]), np.array([1])], np.zeros(3, int), 1.0,
                               np.random.default_rng(0))
    assert [len(s) for s in tie] == [2, 1]


def test_splits_are_seeded_and_keep_domains_apart():
    splits = SimpleNamespace(train_y=torch.tensor([0, 0, 0, 0]), test_y=torch.zeros(8, dtype=torch.long),
                             train_domains=torch.tensor([0, 0, 1, 1]), test_domains=torch.tensor([0] * 4 + [1] * 4),
                             domain_names=["a", "b"], num_classes=1)
    data = FederatedData(splits, [np.array([0, 1]), np.array([2, 3])])
    one = data.personal_test_split(1.0, np.random.default_rng(3))
    assert [s.tolist() for s in one] == [[0, 1, 2, 3], [4, 5, 6, 7]]  # same class, each client its own domain
    labels = np.arange(40) % 4
    clients = [np.arange(0, 20), np.arange(20, 40)]
    a = personal_test_splits(labels, clients, np.arange(100) % 4, 1.0, np.random.default_rng(7))
    b = personal_test_splits(labels, clients, np.arange(100) % 4, 1.0, np.random.default_rng(7))
    c = personal_test_splits(labels, clients, np.arange(100) % 4, 1.0, np.random.default_rng(8))
    assert all(np.array_equal(x, y) for x, y in zip(a, b)) and not all(np.array_equal(x, y) for x, y in zip(a, c))


def test_personal_metrics_hand_computed():
    out = personal_metrics([3, 1, 0], [4, 2, 0])
    assert out["personal_accuracy"] == pytest.approx(4 / 6)  # sample-weighted: all hits over all samples
    assert out["personal_accuracy_min"] == 0.5 and out["personal_accuracy_bottom10"] == 0.5
    assert out["personal_client_accuracy"] == [0.75, 0.5, None]  # an empty split scores nothing
    # 20 clients: the bottom 10 % is the two worst, 0.0 and 0.1.
    many = personal_metrics([i for i in range(20)], [10] * 10 + [100] * 10)
    assert many["personal_accuracy_bottom10"] == pytest.approx(0.05)
    with pytest.raises(ValueError, match="personal_test_fraction"):
        personal_metrics([0], [0])


def test_both_reports_personal_metrics_and_the_global_models_split_scores_add_up(tmp_path):
    summary, rows, run_dir = run_tiny(tmp_path, tiny_config(eval={"mode": "both"}))
    for row in rows:
        assert {"accuracy", "test_loss", "personal_accuracy", "personal_accuracy_min",
                "personal_accuracy_bottom10"} <= set(row)
        # FedAvg's personal model is the global model, and the splits divide the test set: the same score.
        assert row["personal_accuracy"] == pytest.approx(row["accuracy"])
    record = json.loads((run_dir / "partition.json").read_text())["personal_test"]
    assert sum(len(i) for i in record["indices"]) == 360  # the digits test set, all of it handed out
    assert summary["final_personal_accuracy"] == rows[-1]["personal_accuracy"]
    assert summary["personal_client_accuracy"] == rows[-1]["personal_client_accuracy"]
    assert summary["best_personal_accuracy"] == max(r["personal_accuracy"] for r in rows)


def test_personal_mode_scores_the_clients_only_and_finetuning_personalises(tmp_path):
    _, rows, _ = run_tiny(tmp_path, tiny_config(eval={"mode": "personal", "finetune_steps": 5}, train={"rounds": 2}))
    assert all(r["accuracy"] == r["personal_accuracy"] and "test_loss" not in r for r in rows)
    _, plain, _ = run_tiny(tmp_path, tiny_config(eval={"mode": "personal"}, train={"rounds": 2}), name="plain")
    assert [r["loss"] for r in rows] == [r["loss"] for r in plain]  # scoring changes nothing in training
    assert [r["personal_client_accuracy"] for r in rows] != [r["personal_client_accuracy"] for r in plain]


def test_personal_every_and_refusals(tmp_path):
    _, rows, _ = run_tiny(tmp_path, tiny_config(eval={"mode": "both", "personal_every": 2}, train={"rounds": 3}))
    assert ["personal_accuracy" in r for r in rows] == [False, True, True]  # round 2, and the last two (last_k 2)
    # Every 4th round and each of the last 4 (report.last_k): the personal last-k mean averages the rounds
    # scoring every round averages, not rounds 4 and 8.
    cfg = tiny_config(eval={"mode": "both", "personal_every": 4}, train={"rounds": 9}, report={"last_k": 4})
    assert [cfg.eval.personal_round(r, 9, cfg.report.last_k_for(9)) for r in range(1, 10)] == \
        [False, False, False, True, False, True, True, True, True]
    # Scoring the clients less often changes nothing else: the global rows, and the personal scores of the rounds
    # both score, are those of scoring every round (FedBABU fine-tunes each client to score it).
    layers = {"method": {"name": "fedbabu", "finetune_epochs": 1}, "train": {"rounds": 5}}
    _, every, _ = run_tiny(tmp_path, tiny_config(layers, eval={"mode": "both"}), name="every")
    _, sparse, _ = run_tiny(tmp_path, tiny_config(layers, eval={"mode": "both", "personal_every": 4}), name="sparse")
    assert [r["accuracy"] for r in sparse] == [r["accuracy"] for r in every]
    assert [r.get("personal_accuracy") for r in sparse] == [None, None, None] + [r["personal_accuracy"]
                                                                               for r in every[3:]]
    with pytest.raises(ConfigError, match="no personalised model"):
        prepare(tiny_config(method={"name": "zero_shot"}, eval={"mode": "personal"}))


def test_an_early_stopped_run_scores_the_clients_in_its_last_k_rounds(tmp_path):
    """Under eval.early_stop the last rounds are not known in advance: a round is scored once the run could stop
    within report.last_k rounds (stale >= early_stop - last_k + 1), so the personal last-k window and the final
    personal accuracy are those of the rounds the run ended with, not of the every-n grid before them."""
    cfg = tiny_config({"data": {"val_fraction": 0.2, "val_from": "server"},
                       "method": {"name": "fedbabu", "finetune_epochs": 1}, "clients": {"num": 4, "per_round": 4},
                       "seed": 3, "train": {"rounds": 12, "epochs": 1, "batch_size": 32, "lr": 1.0},
                       "eval": {"mode": "both", "personal_every": 5, "early_stop": 2}, "report": {"last_k": 2}})
    # early_stop 2, last_k 2: a round at least 1 round past the best validation accuracy may be in the window
    assert [cfg.eval.personal_round(3, 12, 2, stale) for stale in (None, 0, 1, 2)] == [False, False, True, True]
    assert tiny_config(eval={"mode": "global", "early_stop": 1}, data={"val_fraction": 0.2}
                       ).eval.personal_round(3, 12, 2, 5) is False
    summary, rows, _ = run_tiny(tmp_path, cfg)
    stopped = summary["stopped_early"]["after_round"]
    assert stopped < 12 and len(rows) == stopped
    vals = [r["val_accuracy"] for r in rows]
    stale = [i - max(range(i + 1), key=lambda j: (vals[j], -j)) for i in range(len(vals))]
    assert ["personal_accuracy" in r for r in rows] == [r["round"] % 5 == 0 or s >= 1 for r, s in zip(rows, stale)]
    assert all("personal_accuracy" in r for r in rows[-2:])
    assert summary["final_personal_accuracy"] == rows[-1]["personal_accuracy"]


# Methods of this family that keep something on their clients between rounds, one per state code (FedPer's
# is FedRep's split federation). Every method also runs in worker processes, on flower-sim and deployed in
# tests/e2e/test_every_method.py; SCAFFOLD's client state crosses Ray's actors in test_simulation.py.
FEDREP = {"name": "fedrep", "head_epochs": 1}
POOL = {"name": "local", "workers": 2, "threads_per_worker": 1}
SIM = {"name": "flower-sim", "threads_per_worker": 1, "workers": 1}
PFL = {"eval": {"mode": "both"}, "clients": {"num": 4, "per_round": 2}, "train": {"rounds": 2}}


# flower-sim runs through an in-process Grid (the simulation's messages, record codec and client step on the
# decoded payload): Ray's start-up (~15 s a run) carries nothing method-specific.
@pytest.mark.parametrize("runtime, method", [(POOL, FEDREP)] + [(SIM, m) for m in (
    FEDREP, {"name": "fedala"},
    # BYOL's projector and predictor at the paper's 4096/2048 are ~25 M parameters of client state, which
    # makes every flower-sim round of the tiny run take tens of seconds; small heads keep the same state
    {"name": "fedema", "hidden_dim": 128, "projection_dim": 64, "probe_samples": 200})],
    ids=["pool-fedrep", "flower-sim-fedrep", "flower-sim-fedala", "flower-sim-fedema"])
def test_a_personalised_method_scores_alike_on_every_runtime(tmp_path, monkeypatch, runtime, method):
    # Their state lives in client state on disk, written by worker processes or Flower's clients and read back.
    layers = {**PFL, "method": method}
    if method["name"] == "fedema":
        layers["eval"] = {"mode": "global"}  # self-supervised: evaluated by its linear probe only
    _, ref, _ = run_tiny(tmp_path, tiny_config(layers), name="in-process")
    grids = [] if runtime is POOL else simulation_without_ray(monkeypatch)
    _, rows, run_dir = run_tiny(tmp_path, tiny_config(layers, runtime=runtime), name="other")
    assert without_timing(rows) == without_timing(ref)
    trained = {c for r in rows for c in r["clients"]}
    # FedALA initialises every client's model every round (ala_clients: all), so every client keeps state.
    kept = set(range(4)) if method["name"] == "fedala" else trained
    assert {int(p.name) for p in (run_dir / "client_state" / "committed").iterdir()} == kept
    if runtime is SIM:  # every train message went through the grid, one per client a round
        (grid,) = grids
        assert grid.trains() == sum(len(r["clients"]) for r in rows)


def test_test_subset_keeps_each_cells_share_and_is_the_same_for_every_seed(tmp_path):
    y = torch.tensor([0] * 50 + [1] * 30 + [2] * 1)
    dom = torch.tensor(([0, 1] * 40) + [0])
    splits = DatasetSplits(torch.zeros(4, 1, 2, 2), torch.zeros(4, dtype=torch.long), torch.arange(81.0)[:, None],
                           y, ["a", "b", "c"], torch.zeros(4, dtype=torch.long), dom, ["p", "q"])
    sub, keep = scored_test_subset(splits, 0.2, np.random.default_rng(0))
    # Cells (class, domain): 25 → 5 each for class 0, 15 → 3 each for class 1, the lone class-2 sample kept.
    assert [int(((sub.test_y == c) & (sub.test_domains == d)).sum()) for c in range(3) for d in range(2)] == \
        [5, 5, 3, 3, 1, 0]
    assert torch.equal(sub.test_x[:, 0], torch.from_numpy(keep).float())  # the tensors hold the kept samples
    assert np.array_equal(keep, np.sort(keep)) and torch.equal(sub.train_y, splits.train_y)
    assert scored_test_subset(splits, 1.0, np.random.default_rng(0)) == (splits, None)

    # A run scores only the subset, records it, and hands the personal splits out of it; every seed alike.
    over = {"eval": {"mode": "both", "test_subset": 0.5}, "train": {"rounds": 1}}
    records = []
    for seed in (0, 1):
        _, rows, run_dir = run_tiny(tmp_path, tiny_config(over, seed=seed), name=f"s{seed}")
        records.append(json.loads((run_dir / "partition.json").read_text()))
        assert rows[0]["personal_accuracy"] == pytest.approx(rows[0]["accuracy"])  # splits divide the subset
    subset = records[0]["test_subset"]
    assert subset == records[1]["test_subset"] and subset["samples"] == 180  # half of the 360 digits test images
    personal = sorted(i for split in records[0]["personal_test"]["indices"] for i in split)
    assert personal == subset["indices"]  # recorded as indices into the source's test set
    assert records[0]["personal_test"] != records[1]["personal_test"]  # the split among clients follows the seed
