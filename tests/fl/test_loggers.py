"""Metric loggers (``logging: [csv, tensorboard, wandb]``): what they write, and that a resume duplicates nothing."""
from __future__ import annotations

import csv
import sys
import types
import typing

import pytest

from fedguide.config import Config
from fedguide.fl.engine import Experiment
from fedguide.fl.loggers import LOGGERS, CsvLogger, TensorBoardLogger, scalars
from fedguide.fl.setup import prepare
from fedguide.registry import ConfigError
from tests.tiny import Crash, crash_after, run_tiny, tiny_config


def read_csv(path) -> list[dict[str, str]]:
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def tensorboard_scalars(folder, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)]


def test_scalars_flattens_mappings_and_leaves_lists_out():
    row = {"round": 3, "accuracy": 0.5, "loss": None, "clients": [0, 2], "diverged": False,
           "domain_accuracy": {"mnist": 0.9, "usps": 0.7}}
    assert scalars(row) == {"round": 3, "accuracy": 0.5, "loss": None, "diverged": 0,
                            "domain_accuracy/mnist": 0.9, "domain_accuracy/usps": 0.7}


def test_the_config_names_exactly_the_registered_loggers():
    (entry,) = typing.get_args(Config.model_fields["logging"].annotation)
    assert sorted(typing.get_args(entry)) == LOGGERS.names() == ["csv", "tensorboard", "wandb"]
    with pytest.raises(ConfigError, match="logging.0.*csv"):
        tiny_config(logging=["tensorbord"])


def test_csv_gains_a_column_when_a_later_round_brings_one(tmp_path):
    rows = [{"round": 1, "accuracy": 0.25, "loss": None}]
    logger = CsvLogger(tmp_path, None, [])
    assert not (tmp_path / "metrics.csv").exists()
    logger.log(rows[0], rows)
    rows.append({"round": 2, "accuracy": 0.5, "loss": 1.5, "test_loss": 2.0})
    logger.log(rows[1], rows)
    assert (tmp_path / "metrics.csv").read_text() == ("round,accuracy,loss,test_loss\n"
                                                      "1,0.25,,\n"
                                                      "2,0.5,1.5,2.0\n")


def test_csv_and_tensorboard_follow_a_crashed_and_resumed_run(tmp_path):
    cfg = tiny_config(train={"rounds": 4}, logging=["csv"])
    with pytest.raises(Crash):
        Experiment(prepare(cfg), tmp_path / "run", log=crash_after(2)).run()
    assert [r["round"] for r in read_csv(tmp_path / "run" / "metrics.csv")] == ["1", "2"]
    # Loggers may change on resume: they watch the run, they do not change it.
    _, rows, run_dir = run_tiny(tmp_path, tiny_config(train={"rounds": 4}, logging=["csv", "tensorboard"]),
                                resume=True)
    table = read_csv(run_dir / "metrics.csv")
    assert [int(r["round"]) for r in table] == [1, 2, 3, 4]
    for line, row in zip(table, rows):
        for key, value in scalars(row).items():
            assert line[key] == ("" if value is None else str(value))  # every digit of metrics.jsonl
    # TensorBoard got the history committed before it was turned on, then the new rounds.
    logged = tensorboard_scalars(run_dir / "tensorboard", "accuracy")
    assert [step for step, _ in logged] == [1, 2, 3, 4]
    assert [value for _, value in logged] == pytest.approx([r["accuracy"] for r in rows])


def test_tensorboard_on_resume_hides_what_the_interrupted_process_wrote(tmp_path):
    rows = [{"round": r, "accuracy": r / 10} for r in (1, 2, 3)]
    first = TensorBoardLogger(tmp_path, None, [])
    for i, row in enumerate(rows):
        first.log(row, rows[:i + 1])
    first.close()
    # The checkpoint held rounds 1-2 only; round 3 is trained again and comes out otherwise.
    second = TensorBoardLogger(tmp_path, None, rows[:2])
    again = {"round": 3, "accuracy": 0.9}
    second.log(again, rows[:2] + [again])
    second.close()
    shown = tensorboard_scalars(tmp_path / "tensorboard", "accuracy")
    assert [step for step, _ in shown] == [1, 2, 3]
    assert [value for _, value in shown] == pytest.approx([0.1, 0.2, 0.9])


class FakeWandb(types.ModuleType):
    """The part of wandb's API the logger uses, recording every call."""

    def __init__(self):
        super().__init__("wandb")
        self.inits, self.logged, self.finished = [], [], 0

    def init(self, **kw):
        self.inits.append(kw)
        wandb = self

        class Run:
            def log(self, data, step):
                wandb.logged.append((step, data))

            def finish(self):
                wandb.finished += 1

        return Run()


def test_wandb_logs_each_round_once_across_a_resume(tmp_path, monkeypatch):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    cfg = tiny_config(logging=["wandb"])
    with pytest.raises(Crash):
        Experiment(prepare(cfg), tmp_path / "run", log=crash_after(1)).run()
    _, rows, run_dir = run_tiny(tmp_path, cfg, resume=True)
    assert [step for step, _ in fake.logged] == [1, 2, 3]
    assert [data["accuracy"] for _, data in fake.logged] == [r["accuracy"] for r in rows]
    assert "round" not in fake.logged[0][1] and "clients" not in fake.logged[0][1]
    assert fake.finished == 2  # closed by the crashed process as well
    first, second = fake.inits
    assert first["id"] == second["id"] == (run_dir / "wandb" / "fedguide-run-id").read_text().strip()
    assert first["resume"] == "allow" and first["config"]["logging"] == ["wandb"]


def test_a_missing_optional_package_is_named_before_the_run_starts(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` fail
    with pytest.raises(ConfigError, match="pip install wandb"):
        Experiment(prepare(tiny_config(logging=["csv", "wandb"])), tmp_path / "run")
    assert not (tmp_path / "run").exists()
