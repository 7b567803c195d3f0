"""Faults from outside the process: a second process on the same run folder, SIGTERM from a batch
system, and SIGKILL at random moments, each followed by `fedguide resume`."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests import python_env
from tests.e2e.helpers import REPO, metrics, summary, tiny_config
from fedguide.cli import main
from tests.tiny import without_timing
from fedguide.config import load_config
from fedguide.fl.engine import Experiment
from fedguide.fl.setup import prepare


def wait_for_rounds(run_dir, rounds: int, proc, timeout: float = 120) -> None:
    path = run_dir / "metrics.jsonl"
    deadline = time.time() + timeout
    while not (path.exists() and len(path.read_text().splitlines()) >= rounds):
        if proc.poll() is not None:
            raise AssertionError(f"the run ended early: {proc.stderr.read() if proc.stderr else ''}")
        if time.time() > deadline:
            raise AssertionError("no progress")
        time.sleep(0.01)


@pytest.mark.e2e
def test_a_second_process_on_a_busy_run_folder_is_refused(tmp_path, capsys):
    # The command line in this process (its code, without another interpreter's start-up); the lock's holder
    # is a process of its own.
    cfg = tiny_config(tmp_path / "cfg.yaml")
    run_dir = tmp_path / "run"
    assert main(["run", str(cfg), "--out", str(run_dir), "--quiet", "train.rounds=2"]) == 0
    (run_dir / "summary.json").unlink()  # as if it were still running, held by another process:
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom fedguide.fl.run_lock import RunLock\n"
                               f"with RunLock({str(run_dir)!r}):\n    print('held', flush=True)\n    time.sleep(600)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        capsys.readouterr()
        assert main(["resume", str(run_dir), "--quiet"]) == 2
        err = capsys.readouterr().err
        assert f"in use by another fedguide process (pid {holder.pid})" in err, err
    finally:
        holder.kill()
        holder.wait()
    assert main(["resume", str(run_dir), "--quiet"]) == 0  # the lock went with its holder


@pytest.mark.e2e
def test_sigterm_ends_a_pool_run_like_ctrl_c_and_it_resumes(tmp_path):
    cfg = tiny_config(tmp_path / "cfg.yaml", runtime={"workers": 2, "threads_per_worker": 1})
    run_dir = tmp_path / "run"
    env = {**os.environ, "FEDGUIDE_OFFLINE": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "fedguide.cli", "run", str(cfg), "--out", str(run_dir)],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_rounds(run_dir, 1, proc)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, (out, err)
    assert f"interrupted; continue with: fedguide resume {run_dir}" in out
    assert "leaked semaphore" not in err and "Traceback" not in err, err
    assert main(["resume", str(run_dir), "--quiet"]) == 0
    assert summary(run_dir)["rounds"] == 6


SUITE = """
import sys
from pathlib import Path
from _runs import ensure_run
ensure_run(sys.argv[1], Path(sys.argv[2]), [])
"""


@pytest.mark.e2e
def test_sigterm_to_a_benchmark_suite_stops_its_run_and_leaves_it_resumable(tmp_path):
    """``kill <suite pid>`` reaches the suite's ``fedguide run`` child: it stops as after Ctrl-C instead of
    running on alone with its folder locked."""
    # Rounds enough to be running when the signal arrives (it is sent as round 1 lands), few enough to resume.
    cfg = tiny_config(tmp_path / "cfg.yaml", train={"rounds": 30})
    run_dir = tmp_path / "run"
    suite = subprocess.Popen([sys.executable, "-c", SUITE, str(cfg), str(run_dir)], cwd=REPO, env=python_env(),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_rounds(run_dir, 1, suite)
    child = int((run_dir / ".lock").read_text())
    assert child != suite.pid
    suite.send_signal(signal.SIGTERM)
    out, err = suite.communicate(timeout=120)
    assert suite.returncode == 128 + signal.SIGTERM, (out, err)
    assert f"interrupted; continue with: fedguide resume {run_dir}" in out
    with pytest.raises(ProcessLookupError):  # gone, and reaped by the suite
        os.kill(child, 0)
    assert not (run_dir / "summary.json").exists()
    assert main(["resume", str(run_dir), "--quiet"]) == 0  # the lock went with the run
    assert summary(run_dir)["rounds"] == 30


def in_child(work) -> int:
    """Run ``work`` in a forked child (the parent has loaded torch and the data once); its pid."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            work()
            code = 0
        finally:
            os._exit(code)
    return pid


def finished(pid: int) -> int:
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


@pytest.mark.e2e
def test_sigkill_at_random_moments_always_resumes_to_the_uninterrupted_result(tmp_path):
    """20 runs killed at random moments (mid-round, mid-checkpoint, mid-commit, before the first
    round, during the final writes), each resumed: every result equals the uninterrupted run. The
    runs are forked from this process (torch and the data loaded once, one thread, so forking is safe),
    which keeps 40 runs to seconds."""
    torch.set_num_threads(1)
    cfg = tiny_config(tmp_path / "cfg.yaml", method={"name": "local"}, train={"rounds": 4, "epochs": 1})
    prepared = prepare(load_config(cfg))

    def run(run_dir, resume=False):
        return lambda: Experiment(prepared, run_dir, log=lambda s: None).run(resume=resume)

    run(tmp_path / "warm-up")()  # in this process: the children inherit its imports and caches
    ref = tmp_path / "ref"
    t0 = time.perf_counter()
    assert finished(in_child(run(ref))) == 0
    duration = time.perf_counter() - t0
    expected = without_timing(metrics(ref))
    rng = random.Random(2024)
    for trial in range(20):
        run_dir = tmp_path / f"trial-{trial}"
        pid = in_child(run(run_dir))
        time.sleep(rng.uniform(0.0, 1.1) * duration)
        os.kill(pid, signal.SIGKILL)
        finished(pid)
        if not (run_dir / "summary.json").exists():
            fresh = not (run_dir / "config.yaml").exists()  # killed before the run was written: start it again
            assert finished(in_child(run(run_dir, resume=not fresh))) == 0, f"trial {trial}"
        assert without_timing(metrics(run_dir)) == expected, f"trial {trial}"
        assert json.loads((run_dir / "summary.json").read_text())["accuracy_curve"] == summary(ref)["accuracy_curve"]
