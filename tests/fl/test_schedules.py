"""Learning-rate schedules over rounds (train.schedule): the rates on hand-computed numbers, the rate the clients'
optimisers and SCAFFOLD's control variates see in each round, and the same numbers on every runtime and after a
resume (FedRCL's per-round decay: skynbe/FedRCL, trainers/base_trainer.py line 259)."""
from __future__ import annotations

import json
import math

import pytest

from fedguide.core import training
from fedguide.core.schedules import lr_at
from fedguide.fl.engine import Experiment
from fedguide.fl.setup import prepare
from fedguide.registry import ConfigError
from tests.fl.test_workers import assert_identical, config, run


@pytest.mark.parametrize("name, kw, rounds, expected", [
    ("constant", {}, 4, [0.2, 0.2, 0.2, 0.2]),
    # 0.2 * 0.5^(r-1)
    ("exponential", {"gamma": 0.5}, 4, [0.2, 0.1, 0.05, 0.025]),
    # 0.2 * 0.1^floor((r-1)/2)
    ("step", {"gamma": 0.1, "step_rounds": 2}, 5, [0.2, 0.2, 0.02, 0.02, 0.002]),
    # 0.02 + 0.18 * (1 + cos(pi * (r-1)/4)) / 2: cos 0, pi/4, pi/2, 3pi/4 = 1, 0.707107, 0, -0.707107
    ("cosine", {"min_lr": 0.02}, 4, [0.2, 0.02 + 0.09 * (1 + math.sqrt(0.5)), 0.11, 0.02 + 0.09 * (1 - math.sqrt(0.5))]),
])
def test_the_rate_of_each_round(name, kw, rounds, expected):
    assert [lr_at(name, 0.2, r, rounds, **kw) for r in range(1, rounds + 1)] == pytest.approx(expected)


def test_fedrcls_released_decay_after_a_hundred_rounds():
    # local_lr * 0.998 ** epoch, epoch 99 in round 100: 0.1 * 0.998^99 = 0.0820 (to 4 places)
    assert lr_at("exponential", 0.1, 100, 100, gamma=0.998) == pytest.approx(0.1 * 0.998 ** 99)
    assert round(lr_at("exponential", 0.1, 100, 100, gamma=0.998), 4) == 0.0820


def test_an_unknown_schedule_names_the_choices():
    with pytest.raises(ConfigError, match="train.schedule.name: 'linear' is not one of the choices; write 'constant', "
                                          "'exponential', 'step' or 'cosine'"):
        config(1, train={"rounds": 3, "lr": 0.1, "schedule": {"name": "linear"}})


SCHEDULED = {"rounds": 3, "epochs": 1, "batch_size": 32, "lr": 0.08, "schedule": {"name": "exponential", "gamma": 0.5}}


def test_every_client_optimiser_and_the_run_context_see_the_rounds_rate(tmp_path, monkeypatch):
    seen = []
    make = training.make_optimizer

    def spy(model, cfg):
        seen.append(cfg.lr)
        return make(model, cfg)

    monkeypatch.setattr(training, "make_optimizer", spy)
    from fedguide.methods.classic import scaffold

    upload = scaffold.Scaffold.client_upload
    in_upload = []

    def recording(self, model, ctx, state):
        in_upload.append((ctx.round, self.run.train.lr))
        return upload(self, model, ctx, state)

    monkeypatch.setattr(scaffold.Scaffold, "client_upload", recording)
    cfg = config(1, "scaffold", train=SCHEDULED)
    Experiment(prepare(cfg), tmp_path / "run", log=lambda s: None).run()
    assert sorted(set(seen)) == pytest.approx([0.02, 0.04, 0.08])
    # SCAFFOLD's control variates divide by the rate of the round the client trained in.
    assert sorted(set(in_upload)) == [(1, 0.08), (2, 0.04), (3, 0.02)]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["lr"] for r in rows] == pytest.approx([0.08, 0.04, 0.02])


def test_a_schedule_changes_the_run_and_is_the_same_in_workers(tmp_path):
    plain = run(tmp_path, "plain", config(1, train={**SCHEDULED, "schedule": {"name": "constant"}}))
    one = run(tmp_path, "one", config(1, train=SCHEDULED))
    two = run(tmp_path, "two", config(2, train=SCHEDULED))
    assert [r["accuracy"] for r in one[0]] != [r["accuracy"] for r in plain[0]]
    assert_identical(one, two, "a scheduled run in one process and in two workers")


def test_a_scheduled_run_resumes_to_the_uninterrupted_result(tmp_path):
    full = run(tmp_path, "full", config(1, train=SCHEDULED))
    run(tmp_path, "cut", config(1, train={**SCHEDULED, "rounds": 2}))
    Experiment(prepare(config(1, train=SCHEDULED)), tmp_path / "cut", log=lambda s: None).run(resume=True)
    rows = [json.loads(line) for line in (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()]
    assert [r["accuracy"] for r in rows] == [r["accuracy"] for r in full[0]]
