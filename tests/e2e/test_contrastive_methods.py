"""MOON and FedRCL through the engine on 8x8 digits: what each round does, and that they learn."""
from __future__ import annotations

import math

import pytest
import torch

from fedguide.core.state import ClientStateStore
from tests.tiny import run_tiny, tiny_config, without_timing


def run(tmp_path, name, **over):
    summary, rows, run_dir = run_tiny(tmp_path, tiny_config({"clients": {"num": 4, "per_round": 4}, "seed": 2}, **over), name)
    return summary, without_timing(rows), run_dir


@pytest.mark.e2e
def test_moon_first_round_is_fedavg_then_the_previous_model_takes_part(tmp_path):
    _, avg, _ = run(tmp_path, "fedavg")
    _, moon, moon_dir = run(tmp_path, "moon", method={"name": "moon"})
    # Round 1: every client takes part for the first time, no previous model: exactly FedAvg.
    assert moon[0] == avg[0]
    # From round 2 on the contrastive term is on (and adds to the training loss).
    assert moon[1]["loss"] != avg[1]["loss"]
    assert moon[1]["accuracy"] != avg[1]["accuracy"] or moon[2]["accuracy"] != avg[2]["accuracy"]
    # Each client's last local model is on disk, and only there (not sent up).
    store = ClientStateStore(moon_dir / "client_state")
    for cid in range(4):
        prev = store.get(cid)["prev_weights"]
        assert prev.dtype == torch.float32 and torch.isfinite(prev).all()
    assert moon[0]["bytes_up"] == avg[0]["bytes_up"]


@pytest.mark.e2e
@pytest.mark.parametrize("model", [{"name": "mlp"}, {"name": "resnet10", "width": 8}])
def test_fedrcl_trains_every_level_and_learns(tmp_path, model):
    summary, rows, _ = run(tmp_path, "fedrcl", method={"name": "fedrcl"}, model=model)
    assert all(math.isfinite(r["loss"]) for r in rows)
    # Chance is 10 %; three rounds on the digits get well above it.
    assert summary["best_accuracy"] > 0.5, summary["accuracy_curve"]


@pytest.mark.e2e
def test_fedrcl_loss_includes_the_contrastive_term(tmp_path):
    _, avg, _ = run(tmp_path, "fedavg")
    _, rcl, _ = run(tmp_path, "fedrcl", method={"name": "fedrcl"})
    _, off, _ = run(tmp_path, "fedrcl-off", method={"name": "fedrcl", "weight": 0.0})
    assert off == avg, "weight 0 is FedAvg, round for round"
    assert rcl[0]["loss"] > avg[0]["loss"]


@pytest.mark.e2e
@pytest.mark.parametrize("method", ["moon", "fedrcl"])
def test_worker_processes_give_the_same_result(tmp_path, method):
    # Each worker builds its own frozen models (MOON) and hooks its own live model (FedRCL); MOON's
    # previous models travel through the disk store. Two workers must reproduce one, round for round.
    _, one, _ = run(tmp_path, "one", method={"name": method})
    _, two, _ = run(tmp_path, "two", method={"name": method}, runtime={"workers": 2, "threads_per_worker": 1})
    assert one == two
