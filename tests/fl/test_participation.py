"""Simulated failures and stragglers (clients.dropout, clients.stragglers, clients.straggler_steps): drawn from
(seed, round) alone, left out of aggregation like a deployment's failed clients, a straggler's partial work
aggregated (FedProx's systems heterogeneity, Li et al. 2020, Sec. 5.2), the same in worker processes and after a
resume."""
from __future__ import annotations

import json

import pytest

from fedguide.config import ClientsConfig
from fedguide.fl.engine import Experiment
from fedguide.fl.participation import participation
from fedguide.fl.setup import prepare
from fedguide.methods.base import Method
from tests.fl.test_workers import assert_identical, config, run


def test_the_shares_are_counted_rounded_half_up_from_the_sampled_clients():
    clients = ClientsConfig(num=10, per_round=10, dropout=0.3, stragglers=0.5)
    p = participation(7, 3, 10, clients)
    assert p.sampled == list(range(10))
    assert len(p.dropped) == 3 and set(p.dropped) <= set(p.sampled)
    # half of the 7 that train, 3.5, rounded up
    assert len(p.stragglers) == 4 and set(p.stragglers) <= set(p.training)
    assert p.training == [c for c in range(10) if c not in p.dropped]
    assert participation(7, 3, 10, clients) == p  # a function of (seed, round)
    assert participation(7, 4, 10, clients).dropped != p.dropped or participation(7, 5, 10, clients).dropped != p.dropped


def test_a_round_always_keeps_one_client():
    p = participation(0, 1, 4, ClientsConfig(num=4, per_round=4, dropout=0.99))
    assert len(p.dropped) == 3 and len(p.training) == 1


def test_no_dropout_and_no_stragglers_change_nothing():
    p = participation(3, 2, 6, ClientsConfig(num=6, per_round=4))
    assert p.dropped == [] and p.stragglers == [] and p.training == p.sampled


SHAKY = {"num": 6, "per_round": 4, "dropout": 0.25, "stragglers": 0.5, "straggler_steps": 2}


def test_failed_clients_upload_nothing_and_stragglers_take_their_steps(tmp_path, monkeypatch):
    seen = []
    upload = Method.client_upload

    def recording(self, model, ctx, state):
        seen.append((ctx.round, ctx.client_id, ctx.steps))
        return upload(self, model, ctx, state)

    monkeypatch.setattr(Method, "client_upload", recording)
    cfg = config(1, clients=SHAKY)
    summary = Experiment(prepare(cfg), tmp_path / "run", log=lambda s: None).run()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    full_steps = None
    for r in rows:
        p = participation(cfg.seed, r["round"], 6, cfg.clients)
        assert r["clients"] == p.sampled and r["dropped_clients"] == p.dropped and len(p.dropped) == 1
        assert r["straggler_clients"] == p.stragglers and len(p.stragglers) == 2  # half of 3, rounded up
        trained = {cid: steps for rnd, cid, steps in seen if rnd == r["round"]}
        assert sorted(trained) == p.training  # a failed client did not train
        for cid, steps in trained.items():
            if cid in p.stragglers:
                assert steps == 2
            else:
                assert steps > 2
                full_steps = steps
    assert full_steps is not None
    assert summary["client_dropouts"] == 3 and summary["client_stragglers"] == 6


def test_failures_change_the_run_and_are_the_same_in_workers_and_after_a_resume(tmp_path):
    plain = run(tmp_path, "plain", config(1))
    one = run(tmp_path, "one", config(1, clients=SHAKY))
    assert [r["accuracy"] for r in one[0]] != [r["accuracy"] for r in plain[0]]
    assert_identical(one, run(tmp_path, "two", config(2, clients=SHAKY)), "dropout and stragglers in two workers")
    cut = config(1, clients=SHAKY, train={"rounds": 2, "epochs": 1, "batch_size": 32, "lr": 0.05})
    run(tmp_path, "cut", cut)
    Experiment(prepare(config(1, clients=SHAKY)), tmp_path / "cut", log=lambda s: None).run(resume=True)
    rows = [json.loads(line) for line in (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()]
    assert [r["accuracy"] for r in rows] == [r["accuracy"] for r in one[0]]


@pytest.mark.parametrize("key, value, named", [("dropout", 1.0, "clients.dropout"),
                                                ("stragglers", 1.5, "clients.stragglers"),
                                                ("straggler_steps", 0, "clients.straggler_steps")])
def test_impossible_shares_are_refused_naming_the_key(key, value, named):
    from fedguide.registry import ConfigError

    with pytest.raises(ConfigError, match=named):
        config(1, clients={"num": 6, "per_round": 4, key: value})
