"""The round loop in-process on 8x8 digits: sampling, determinism, Local and Centralized semantics."""
from __future__ import annotations

import json

import pytest
import torch

from fedguide.fl.setup import open_run, prepare
from fedguide.core.seeding import sample_clients
from fedguide.core.state import ClientStateStore
from fedguide.registry import ConfigError
from fedguide.config import build_config
from tests.tiny import run_tiny, tiny_config, tiny_raw


def config(**over):
    return tiny_config(**over)


def run(tmp_path, name="run", **over):
    return run_tiny(tmp_path, config(**over), name)


def test_client_sampling_is_seeded_sorted_and_varies_by_round():
    a = [sample_clients(0, r, 10, 3) for r in range(1, 6)]
    assert a == [sample_clients(0, r, 10, 3) for r in range(1, 6)]
    assert all(x == sorted(x) and len(set(x)) == 3 for x in a)
    assert len({tuple(x) for x in a}) > 1
    assert sample_clients(0, 1, 10, 10) == list(range(10))


def test_same_seed_same_result_other_seed_other_result(tmp_path):
    s1, r1, _ = run(tmp_path, "a")
    s2, r2, _ = run(tmp_path, "b")
    s3, _, _ = run(tmp_path, "c", seed=2)
    assert s1["accuracy_curve"] == s2["accuracy_curve"]
    assert [r["clients"] for r in r1] == [r["clients"] for r in r2]
    assert s1["accuracy_curve"] != s3["accuracy_curve"]


def test_rounds_sample_per_round_clients_and_count_bytes(tmp_path):
    summary, rows, run_dir = run(tmp_path)
    for r in rows:
        assert len(r["clients"]) == 2
    # FedAvg sends the global weights down and the local weights up: equal bytes per client.
    assert rows[0]["bytes_down"] == rows[0]["bytes_up"] - 2 * 8  # uploads add num_samples (8 bytes each)
    assert summary["final_accuracy"] == rows[-1]["accuracy"]
    assert summary["best_accuracy"] == max(r["accuracy"] for r in rows)
    assert summary["final_accuracy"] > 0.5, "3 rounds on digits learn something"


def test_local_keeps_one_model_per_client_and_reports_their_mean(tmp_path):
    summary, rows, run_dir = run(tmp_path, method={"name": "local"}, clients={"num": 4, "per_round": 4})
    assert all(r["bytes_down"] == 0 for r in rows)  # nothing is communicated down
    store = ClientStateStore(run_dir / "client_state")
    states = [store.get(c) for c in range(4)]
    assert all("weights" in s for s in states)
    assert not torch.equal(states[0]["weights"], states[1]["weights"])
    # Recompute the reported accuracy from the stored client models.
    prepared = prepare(config(method={"name": "local"}, clients={"num": 4, "per_round": 4}))
    ctx, _ = open_run(prepared, tmp_path / "scratch")
    accs = [ctx.evaluator.evaluate(s["weights"])["accuracy"] for s in states]
    assert rows[-1]["accuracy"] == pytest.approx(sum(accs) / 4)
    assert rows[-1]["client_accuracy_min"] == pytest.approx(min(accs))


def test_centralized_is_one_client_holding_all_partitioned_data(tmp_path):
    prepared = prepare(config(method={"name": "centralized"}))
    fed = prepare(config()).data
    assert prepared.data.num_clients == 1
    assert len(prepared.data.client_indices[0]) == sum(len(p) for p in fed.client_indices)
    summary, rows, _ = run(tmp_path, method={"name": "centralized"})
    assert summary["num_clients"] == 1 and all(r["clients"] == [0] for r in rows)


def test_fraction_subsamples_the_training_set_stratified(tmp_path):
    full = prepare(config()).data
    quarter = prepare(config(data={"name": "digits", "fraction": 0.25})).data
    n_full = sum(len(p) for p in full.client_indices)
    n_q = sum(len(p) for p in quarter.client_indices)
    assert abs(n_q - 0.25 * n_full) <= 10
    counts = quarter.class_counts().sum(0)
    assert counts.min() >= 0.2 * n_full / 10 * 0.9  # every class keeps its share


def test_public_pool_is_fixed_stratified_and_never_given_to_clients():
    data = prepare(config(data={"name": "digits", "public_fraction": 0.1})).data
    public = set(data.public_indices.tolist())
    labels = data.splits.train_y.numpy()
    assert abs(len(public) - 0.1 * len(labels)) <= 10
    assert min(torch.bincount(torch.as_tensor(labels[sorted(public)]), minlength=10).tolist()) >= 10
    assert not public & set(int(i) for p in data.client_indices for i in p)
    other_seed = prepare(config(seed=5, data={"name": "digits", "public_fraction": 0.1})).data
    assert set(other_seed.public_indices.tolist()) == public, "the pool does not move with the run seed"
    moved = prepare(config(data={"name": "digits", "public_fraction": 0.1, "public_seed": 1})).data
    assert set(moved.public_indices.tolist()) != public
    without = prepare(config()).data
    assert all((a == b).all() for a, b in zip(without.client_indices, prepare(config()).data.client_indices))


def test_public_pool_is_recorded_in_the_run(tmp_path):
    _, _, run_dir = run(tmp_path, data={"name": "digits", "public_fraction": 0.1}, train={"rounds": 1})
    record = json.loads((run_dir / "partition.json").read_text())
    assert record["public_samples"] > 100


def test_unlabeled_clients_are_refused_by_methods_that_train_on_labels():
    cfg = build_config(tiny_raw(partition=None) | {"partition": {"name": "semi_supervised", "server_fraction": 0.2}})
    with pytest.raises(ConfigError, match="trains on client labels"):
        prepare(cfg)
