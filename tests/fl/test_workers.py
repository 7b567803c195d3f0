"""Clients trained in worker processes: identical results for any number of workers; crashes reported. Every method
in the worker pool: tests/e2e/test_every_method.py."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from safetensors.torch import load_file

from fedguide.config import build_config
from fedguide.fl.engine import Experiment
from fedguide.fl.setup import prepare
from fedguide.fl.runtimes.local import DEFAULT_THREADS, LocalParams, WorkerCrashed, auto_workers, resolve_workers
from fedguide.fl.engine import TIMING_METRICS
from tests import python_env
from tests.tiny import SWEEP_OVERRIDES


def config(workers, method="fedavg", **over):
    name = method["name"] if isinstance(method, dict) else method
    raw = {
        "data": {"name": "digits"},
        "partition": {"name": "dirichlet", "alpha": 0.5, "min_size": 5},
        "model": {"name": "mlp"},
        # a method's name or a whole method section, over the sweeps' sizes for that method
        "method": {"name": name, **SWEEP_OVERRIDES.get(name, {}), **(method if isinstance(method, dict) else {})},
        "clients": {"num": 6, "per_round": 4},
        "train": {"rounds": 3, "epochs": 1, "batch_size": 32, "lr": 0.05},
        "runtime": {"workers": workers, "threads_per_worker": 1},
        "seed": 5,
    }
    raw.update(over)
    return build_config(raw)


def run(tmp_path, name, cfg):
    run_dir = tmp_path / name
    Experiment(prepare(cfg), run_dir, log=lambda s: None).run()
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return rows, load_file(run_dir / "model.safetensors")


STRIP = TIMING_METRICS


def assert_identical(a, b, label):
    (rows_a, w_a), (rows_b, w_b) = a, b
    assert [{k: v for k, v in r.items() if k not in STRIP} for r in rows_a] == \
           [{k: v for k, v in r.items() if k not in STRIP} for r in rows_b], label
    for k in w_a:
        assert torch.equal(w_a[k], w_b[k]), (label, k)


def test_results_are_bit_identical_for_1_and_4_workers(tmp_path):
    # two workers: every method in tests/e2e/test_every_method.py
    assert_identical(run(tmp_path, "w1", config(1)), run(tmp_path, "w4", config(4)), 4)


def worker_pids() -> list[int]:
    """The pool's worker processes: this process's children started by spawn, or the fork server's children."""
    def children(pid):
        return [int(p) for p in os.popen(f"pgrep -P {pid}").read().split()]

    found = []
    for pid in children(os.getpid()):
        try:
            cmdline = open(f"/proc/{pid}/cmdline").read()
        except FileNotFoundError:  # the pgrep that listed it
            continue
        if "forkserver" in cmdline:
            found += children(pid)
        elif "spawn" in cmdline:
            found.append(pid)
    return found


def test_a_killed_worker_stops_the_run_with_the_client_named_and_leaves_no_orphans(tmp_path):
    cfg = config(2, train={"rounds": 50, "epochs": 20, "batch_size": 8, "lr": 0.01})
    exp = Experiment(prepare(cfg), tmp_path / "run", log=lambda s: None)
    victims = []

    def kill_a_worker():
        # Wait until round 1 is checkpointed and the pool is busy with round 2, then kill one worker.
        metrics = tmp_path / "run" / "metrics.jsonl"
        deadline = time.time() + 60
        while time.time() < deadline and not (metrics.exists() and metrics.read_text().strip()):
            time.sleep(0.01)
        children = worker_pids()
        victims.extend(children)
        os.kill(children[0], signal.SIGKILL)

    killer = threading.Thread(target=kill_a_worker)
    killer.start()
    with pytest.raises(WorkerCrashed, match=r"killed by signal 9\) while training client \d+ in round \d+"):
        exp.run()
    killer.join()
    time.sleep(0.5)
    for pid in victims[1:]:
        assert not os.path.exists(f"/proc/{pid}") or "zombie" in open(f"/proc/{pid}/status").read().lower()
    # The last completed round is checkpointed: the run resumes from it.
    assert (tmp_path / "run" / "checkpoints" / "last.safetensors").exists()


def test_auto_picks_processes_from_cores_and_model_size():
    assert auto_workers(cores=2, per_round=10, num_params=600_000) == (1, 2)  # in-process wins on 2 cores
    assert auto_workers(cores=4, per_round=10, num_params=600_000) == (4, 1)
    assert auto_workers(cores=16, per_round=10, num_params=600_000) == (10, 1)
    assert auto_workers(cores=16, per_round=10, num_params=20_000_000) == (8, 2)
    assert auto_workers(cores=1, per_round=10, num_params=600_000) == (1, 1)
    rt = config(3).runtime
    assert resolve_workers(rt, per_round=2, num_params=10, cores=8) == (2, 1)  # never more than clients
    # In-process clients get torch's start-up default even after another run changed the count.
    torch.set_num_threads(1)
    try:
        assert resolve_workers(LocalParams(workers=1), per_round=4, num_params=10, cores=8) == (1, DEFAULT_THREADS)
    finally:
        torch.set_num_threads(DEFAULT_THREADS)


def test_a_script_without_main_guard_fails_clearly_instead_of_hanging(tmp_path):
    # spawn re-imports the script in each worker, where starting another pool fails at once
    script = tmp_path / "unguarded.py"
    script.write_text(
        "from tests.tiny import tiny_config\n"
        "from fedguide.fl.engine import Experiment\n"
        "from fedguide.fl.setup import prepare\n"
        "cfg = tiny_config(runtime={'workers': 2, 'threads_per_worker': 1}, train={'rounds': 1})\n"
        f"Experiment(prepare(cfg), {str(tmp_path / 'run')!r}, log=lambda s: None).run()\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                          env=python_env())
    assert proc.returncode != 0
    assert "WorkerCrashed" in proc.stderr and "__main__" in proc.stderr


def report_environment(results, environ) -> None:
    results.put(os.environ.get("FEDGUIDE_POOL_MARK"))
    if environ is not None:
        from fedguide.fl.runtimes.local import adopt_environment

        adopt_environment(environ)
        results.put(os.environ.get("FEDGUIDE_POOL_MARK"))


def test_a_worker_takes_the_servers_environment_of_the_moment_its_pool_starts(monkeypatch):
    # The fork server keeps the environment it started with; a pool started after a change must not miss it.
    from fedguide.fl.runtimes.local import worker_context

    ctx = worker_context()
    results = ctx.Queue()
    first = ctx.Process(target=report_environment, args=(results, None))
    first.start()  # starts the fork server (the first time) before the variable exists
    assert results.get(timeout=60) is None
    first.join()
    monkeypatch.setenv("FEDGUIDE_POOL_MARK", "set later")
    later = ctx.Process(target=report_environment, args=(results, dict(os.environ)))
    later.start()
    seen = [results.get(timeout=60), results.get(timeout=60)]
    later.join()
    if ctx.get_start_method() == "forkserver":
        assert seen == [None, "set later"]  # inherited from the fork server: stale; adopted: the server's
    else:
        assert seen == ["set later", "set later"]
