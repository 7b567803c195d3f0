"""SIGKILL after a completed round, then `fedguide resume`: the result equals an uninterrupted run."""
from __future__ import annotations

import signal
import time

import pytest
import torch

from tests.e2e.helpers import cli, metrics, popen, summary, tiny_config, weights
from fedguide.cli import main
from fedguide.config import load_config
from fedguide.fl.engine import TIMING_METRICS, Experiment
from fedguide.fl.setup import prepare

TIMING_KEYS = TIMING_METRICS


def _without_timing(rows):
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in rows]


def _kill_after(cfg, run_dir, rounds_done: int) -> int:
    """Start a run, SIGKILL it once `rounds_done` rounds are on disk; returns the rounds it had."""
    proc = popen("run", str(cfg), "--out", str(run_dir), "--quiet")
    path = run_dir / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline:
        if path.exists() and len(path.read_text().splitlines()) >= rounds_done:
            break
        if proc.poll() is not None:
            raise AssertionError(f"run ended before it could be killed: {proc.stderr.read()}")
        time.sleep(0.002)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (run_dir / "summary.json").exists(), "the run finished before the kill; make rounds slower"
    return len(path.read_text().splitlines())


@pytest.mark.e2e
@pytest.mark.parametrize(
    "method,kill_after",
    [("fedavg", 1), ("moon", 2), ("fedrcl", 2)],
    # moon keeps per-client state on disk (the previous local model), fedrcl a contrastive term over it. Kills at
    # every moment of a run (mid-round, mid-checkpoint, during the final writes), with the local method's
    # per-client state, are tests/e2e/test_faults.py's twenty random SIGKILLs; here the user's path: a
    # `fedguide run` process killed, `fedguide resume` continuing it.
)
def test_killed_run_resumes_to_identical_result(tmp_path, method, kill_after):
    cfg = tiny_config(tmp_path / "cfg.yaml", method={"name": method})
    ref, killed = tmp_path / "ref", tmp_path / "killed"
    # The uninterrupted reference in this process (`fedguide run` is this call behind its arguments); the
    # killed run is a process of its own, as a user's would be, and `fedguide resume` continues what it left
    # on disk (in this process: its command line's code, without another interpreter's start-up).
    Experiment(prepare(load_config(cfg)), ref, log=lambda s: None).run()
    done = _kill_after(cfg, killed, kill_after)
    assert done >= kill_after
    assert main(["resume", str(killed), "--quiet"]) == 0

    a, b = summary(ref), summary(killed)
    for key in ("accuracy_curve", "final_accuracy", "best_accuracy", "best_round", "bytes_up_total"):
        assert a[key] == b[key], key
    assert _without_timing(metrics(ref)) == _without_timing(metrics(killed))
    wa, wb = weights(ref), weights(killed)
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


@pytest.mark.e2e
def test_resume_of_a_complete_run_changes_nothing(tmp_path, capsys):
    cfg = tiny_config(tmp_path / "cfg.yaml", train={"rounds": 2})
    run = tmp_path / "run"
    assert main(["run", str(cfg), "--out", str(run), "--quiet"]) == 0
    before = (run / "summary.json").read_text()
    capsys.readouterr()
    out = cli("resume", str(run))  # a process of its own: what a user types
    assert "already complete" in out.stdout
    assert (run / "summary.json").read_text() == before


@pytest.mark.e2e
def test_run_refuses_to_overwrite_an_existing_run(tmp_path):
    cfg = tiny_config(tmp_path / "cfg.yaml", train={"rounds": 1})
    run = tmp_path / "run"
    assert main(["run", str(cfg), "--out", str(run), "--quiet"]) == 0
    before = (run / "metrics.jsonl").read_text()
    proc = cli("run", str(cfg), "--out", str(run), check=False)
    assert proc.returncode == 2
    assert "fedguide resume" in proc.stderr
    assert (run / "metrics.jsonl").read_text() == before
