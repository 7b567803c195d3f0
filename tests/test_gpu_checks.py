"""benchmarks/gpu_checks.py's own logic, on any machine: what a method's runs are given, how the determinism
check waits, and which arguments it refuses (the checks themselves run in tests/gpu and the device check)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

import gpu_checks as checks
from fedguide.methods import METHODS


def test_each_method_runs_on_the_network_it_requires(tmp_path):
    pipelines = checks.Pipelines(tmp_path / "pipelines")  # built only when a guided method asks for one
    _, overrides = checks.method_overrides("fedbn", pipelines)
    assert "model.batch_norm=true" in overrides
    for name in METHODS.names():
        if checks.guided(name):
            continue
        _, overrides = checks.method_overrides(name, pipelines)
        for key, value in METHODS.get(name).obj.model_requirements.items():
            assert f"model.{key}={json.dumps(value)}" in overrides, name


def test_the_determinism_check_waits_without_a_deadline():
    """pytest's version passes an infinite deadline: it waits for both runs instead of refusing the timeout."""
    line = json.dumps({"rows": [{"loss": 1.0}], "weights": "abc"})
    procs = [subprocess.Popen([sys.executable, "-c", f"print({line!r})"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    status, detail, _ = checks.finish_determinism(procs, deadline=float("inf"))
    assert status == "ok", detail


def test_an_unknown_method_or_check_is_refused_by_name(capsys):
    with pytest.raises(SystemExit):
        checks.main(["--device", "simulated", "--only", "fedavg", "fedsgd"])
    assert "--only names no registered method: fedsgd" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        checks.main(["--device", "simulated", "--checks", "speed"])
    assert "invalid choice: 'speed'" in capsys.readouterr().err
