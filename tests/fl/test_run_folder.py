"""The run folder: its states, the settings comparison behind resume and sweeps, and the hint after an
interruption."""
from __future__ import annotations

import pytest

from fedguide.fl.run_folder import RunFolder, compare_pinned, pinned_config
from fedguide.registry import ConfigError
from tests.tiny import run_tiny, tiny_config


def test_an_interruption_before_the_config_is_written_hints_a_command_that_works(tmp_path):
    """Stopped during set-up (feature extraction, generation), the folder holds no config.yaml yet: `resume`
    could not read it, so the hint is to start again into the same folder, which the fresh check accepts."""
    folder = RunFolder(tmp_path / "run")
    folder.path.mkdir()
    (folder.path / ".lock").write_text("123\n")  # what a stopped run leaves before its config
    assert folder.continue_hint() == ("nothing of the run was kept yet; start it again with the same command and "
                                      f"--out {folder.path}")
    folder.check_fresh()  # no error: the same command runs
    assert folder.state(3) == "new"
    folder.write_config(tiny_config())
    assert folder.continue_hint() == f"continue with: fedguide resume {folder.path}"
    with pytest.raises(ConfigError, match="already holds a run"):
        folder.check_fresh()


def test_states_and_the_one_settings_rule(tmp_path):
    cfg = tiny_config(train={"rounds": 2})
    _, _, run_dir = run_tiny(tmp_path, cfg)
    folder = RunFolder(run_dir)
    assert folder.state(2) == "finished" and folder.state(3) == "unfinished"
    cfg = folder.read_config()  # resolved: every default written out
    assert folder.compare(cfg).same
    moved = cfg.model_copy(update={"train": cfg.train.model_copy(update={"device": "simulated", "rounds": 5})})
    assert folder.compare(moved).same  # where it computes and how long it runs are not its settings
    other = cfg.model_copy(update={"train": cfg.train.model_copy(update={"lr": 0.5})})
    assert folder.compare(other).differences == ["train.lr: 0.05 (run folder) vs 0.5 (this config)"]
    (run_dir / "stopped.json").write_text("{}")
    assert folder.state(3) == "stopped"


def test_a_resume_may_raise_the_rounds_only(tmp_path):
    cfg = tiny_config(train={"rounds": 2})
    folder = RunFolder(tmp_path)
    folder.write_config(cfg)
    held = pinned_config(cfg)
    longer = cfg.model_copy(update={"train": cfg.train.model_copy(update={"rounds": 4})})
    lines = []
    assert folder.resume_notes(held, longer, {}, lines.append) == {"rounds_raised_from": 2}
    assert lines == ["train.rounds raised from 2 to 4: the run continues to round 4"]
    assert folder.read_config().train.rounds == 4  # config.yaml follows the run
    shorter = cfg.model_copy(update={"train": cfg.train.model_copy(update={"rounds": 1})})
    with pytest.raises(ConfigError, match=r"train.rounds may only be raised\):\n  train.rounds: 2 \(checkpoint\) vs 1"):
        folder.resume_notes(held, shorter, {}, lines.append)
    assert not compare_pinned(held, pinned_config(longer), ("a", "b")).differences


def fedprox_gains_a_parameter(monkeypatch):
    """A later fedguide whose FedProx has a parameter more (at a default that changes nothing)."""
    import dataclasses

    from pydantic import create_model

    from fedguide.methods import METHODS

    entry = METHODS.get("fedprox")
    newer = create_model("NewerFedProxParams", __base__=entry.params, anneal=(float, 0.0))
    monkeypatch.setitem(METHODS._entries, "fedprox", dataclasses.replace(entry, params=newer))


def test_a_run_resumes_and_sweeps_on_after_its_method_gained_a_parameter(tmp_path, monkeypatch):
    from fedguide.fl.setup import prepare
    from tests.tiny import Crash, crash_after

    cfg = tiny_config(method={"name": "fedprox", "mu": 0.01}, train={"rounds": 3})
    with pytest.raises(Crash):
        run_tiny(tmp_path, cfg, log=crash_after(2))
    folder = RunFolder(tmp_path / "run")
    with monkeypatch.context() as m:
        fedprox_gains_a_parameter(m)
        newer = prepare(folder.read_config()).resolved
        assert newer.config.method.params_dict()["anneal"] == 0.0  # the new default is written out now
        assert folder.compare(newer).same  # the sweep planner's comparison
        summary, rows, _ = run_tiny(tmp_path, folder.read_config(), resume=True)
        assert summary["rounds"] == 3 and len(rows) == 3
        edited = prepare(tiny_config(method={"name": "fedprox", "mu": 0.01, "anneal": 0.5}, train={"rounds": 3})).resolved
        assert any("method.anneal" in d for d in folder.compare(edited).differences)  # a value set is an edit
