"""The flower-sim runtime: the record codec, client errors, and runs identical to the local runtime."""
from __future__ import annotations

import math
import os
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import load_file

from fedguide.fl.client_step import ClientResult
from fedguide.fl.runtimes.flower.processes import command_line, is_ray_process
from fedguide.fl.runtimes.flower.records import decode, encode
from fedguide.fl.runtimes.flower.simulated_clients import (FlowerClientFailed, FlowerClients, actors_and_threads,
                                                           descendants, results_in_job_order)
from fedguide.fl.runtimes.flower.simulation import FlowerSimParams
from tests.tiny import run_tiny, tiny_config, tiny_raw, without_timing

pytest.importorskip("flwr")
pytest.importorskip("ray")


def assert_same_record(a, b, path=""):
    assert sorted(a) == sorted(b), path
    for k, v in a.items():
        w = b[k]
        if isinstance(v, torch.Tensor):
            assert isinstance(w, torch.Tensor) and w.dtype == v.dtype and w.shape == v.shape, path + k
            assert torch.equal(w, v), path + k
        elif isinstance(v, dict):
            assert_same_record(v, w, path + k + "/")
        elif isinstance(v, float) and math.isnan(v):
            assert isinstance(w, float) and math.isnan(w), path + k
        else:
            assert type(w) is type(v) and w == v, path + k


def test_codec_round_trip_keeps_dtype_shape_and_nesting():
    record = {
        "weights": torch.randn(7, 3),
        "half": torch.randn(4, dtype=torch.bfloat16),
        "mask": torch.tensor([True, False, True]),
        "step": torch.tensor(5, dtype=torch.int64),  # 0-dim
        "none_yet": torch.empty(0, 2),
        "strided": torch.arange(12.0).reshape(3, 4).t(),  # not contiguous
        "num_samples": 17, "loss": 0.25, "nan": float("nan"), "flag": True, "name": "fedavg",
        "count": np.int64(3),
        "nested": {"control": torch.ones(2, dtype=torch.float64), "deeper": {"k": 2, "empty": {}}},
        "nothing": {},
    }
    arrays, scalars = encode(record)
    back = decode(arrays, scalars)
    expected = {**record, "count": 3}
    assert_same_record(expected, back)
    assert type(back["flag"]) is bool and type(back["count"]) is int
    back["weights"].add_(1)  # decoded tensors are writable copies, not views of the message
    assert not torch.equal(back["weights"], record["weights"])


@pytest.mark.parametrize("bad, fragment", [({"a/b": 1}, "a/b"), ({"x": [1, 2]}, "'x' is a list"),
                                           ({"d": {3: 1.0}}, "d/3"), ({"n": None}, "NoneType")])
def test_codec_refuses_what_it_cannot_carry_exactly(bad, fragment):
    with pytest.raises(TypeError, match=fragment):
        encode(bad)


def test_actor_count_defaults_to_cores_and_one_thread():
    assert actors_and_threads(FlowerSimParams(), per_round=8, cores=2) == (2, 1)
    assert actors_and_threads(FlowerSimParams(), per_round=1, cores=16) == (1, 1)
    assert actors_and_threads(FlowerSimParams(workers=3, threads_per_worker=2), 8, cores=2) == (3, 2)
    assert actors_and_threads(FlowerSimParams(workers=1), per_round=8, cores=2) == (1, 1)  # 1 is one actor


def reply(node, error=None, result=None):
    content = None
    if result is not None:
        arrays, scalars = encode(result.upload)
        content = {"upload-arrays": arrays, "upload-scalars": scalars,
                   "result": {"client-id": result.client_id, "loss": result.loss,
                              "num-samples": result.num_samples, "fit-seconds": result.fit_seconds}}
    return SimpleNamespace(metadata=SimpleNamespace(src_node_id=node), has_error=lambda: error is not None,
                           error=SimpleNamespace(reason=error), content=content)


def test_replies_come_back_in_job_order():
    a = ClientResult(3, {"weights": torch.ones(2), "num_samples": 5}, 0.5, 5, 0.1)
    b = ClientResult(1, {"weights": torch.zeros(2), "num_samples": 7}, 0.25, 7, 0.2)
    got = results_in_job_order(2, [1, 3], {901: 3, 902: 1}, [reply(901, result=a), reply(902, result=b)])
    assert [r.client_id for r in got] == [1, 3]
    assert got[0].loss == 0.25 and got[0].num_samples == 7 and torch.equal(got[1].upload["weights"], torch.ones(2))
    with pytest.raises(FlowerClientFailed, match=r"clients \[3\] sent no reply in round 2"):
        results_in_job_order(2, [1, 3], {901: 3, 902: 1}, [reply(902, result=b)])


def test_a_failed_client_is_named():
    """A reply carrying an error stops the round with the client's id and the error's last lines."""
    failed = reply(901, error="Traceback ...\n  File x\nFloatingPointError: client 2 diverged")
    with pytest.raises(FlowerClientFailed, match=r"client 2 failed in round 4:\n(.|\n)*FloatingPointError: client 2 diverged"):
        results_in_job_order(4, [2], {901: 2}, [failed])
    wrapped = reply(901, error="Traceback ...\nClientAppException: \nException ClientAppException occurred. "
                               "Message: client 2 diverged in round 4")
    with pytest.raises(FlowerClientFailed, match=r"client 2 failed in round 4:\nclient 2 diverged in round 4$"):
        results_in_job_order(4, [2], {901: 2}, [wrapped])


def test_ray_processes_are_told_by_their_program_not_their_arguments(tmp_path):
    """A fork server started after `import ray` carries Ray's folders in its sys.path argument: not Ray's. A worker
    titled ray::..., raylet, and a script of Ray's package are."""
    import subprocess
    import sys
    import time

    script = tmp_path / "site-packages" / "ray" / "dashboard.py"
    script.parent.mkdir(parents=True)
    script.write_text("import time\ntime.sleep(30)\n")
    sleeper = "import time; time.sleep(30)  # sys_path: ['/x/site-packages/ray/thirdparty_files']"
    procs = {"worker": subprocess.Popen(["bash", "-c", "exec -a ray::IDLE sleep 30"]),
             "raylet": subprocess.Popen(["bash", "-c", f"exec -a {tmp_path}/raylet sleep 30"]),
             "script": subprocess.Popen([sys.executable, "-u", str(script)]),
             "fork server": subprocess.Popen([sys.executable, "-B", "-c", sleeper])}
    try:
        deadline = time.time() + 30
        # Until bash has exec'd its program under the new name (mid-exec the command line reads empty).
        while not all((line := command_line(p.pid)) and not line.startswith("bash") for p in procs.values()):
            assert time.time() < deadline, {name: command_line(p.pid) for name, p in procs.items()}
            time.sleep(0.02)
        verdict = {name: is_ray_process(p.pid) for name, p in procs.items()}
    finally:
        for p in procs.values():
            p.kill()
            p.wait()
    assert verdict == {"worker": True, "raylet": True, "script": True, "fork server": False}
    assert not is_ray_process(procs["worker"].pid)  # gone


def files(run_dir: Path) -> list[str]:
    return sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*") if p.is_file())


def ray_like(pids) -> list[str]:
    """The Ray processes among ``pids``, each as "pid: command line" so that a failure names what was left."""
    return [f"{p}: {command_line(p)[:200]}" for p in sorted(pids) if is_ray_process(p)]


@pytest.mark.e2e
# SCAFFOLD: FedAvg's path plus a payload and client state of its own (FedAvg and FedProx send and keep less;
# one Ray start-up each cost the suite ~18 s for nothing SCAFFOLD does not exercise; the personalised methods'
# client state runs on flower-sim in tests/fl/test_personal_eval.py).
@pytest.mark.parametrize("method", [{"name": "scaffold"}])
def test_flower_sim_matches_local_runtime(tmp_path, monkeypatch, method):
    import fedguide.fl.runtimes.flower.simulation as simulation

    started = []

    class Recorded(FlowerClients):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            started.append(self)

    monkeypatch.setattr(simulation, "FlowerClients", Recorded)
    layers = {"method": method, "clients": {"num": 4, "per_round": 3}, "train": {"rounds": 2}}
    _, local_rows, local_dir = run_tiny(tmp_path, tiny_config(layers), "local")
    summary, sim_rows, sim_dir = run_tiny(
        tmp_path, tiny_config(layers, runtime={"name": "flower-sim", "threads_per_worker": 1}), "flower")

    (clients,) = started
    assert [r["accuracy"] for r in sim_rows] == pytest.approx([r["accuracy"] for r in local_rows], abs=1e-6)
    assert without_timing(sim_rows) == without_timing(local_rows)  # losses, clients, bytes alike
    assert summary["threads_per_worker"] == 1 and summary["workers"] == clients.actors
    assert files(sim_dir) == files(local_dir)
    for path in files(local_dir):
        if path.startswith("client_state/") and path.endswith(".safetensors"):
            a, b = load_file(local_dir / path), load_file(sim_dir / path)
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), path
    # Every process Ray started is gone, and nothing Ray-like is left under this process.
    assert clients.ray_pids, "the executor recorded no Ray processes"
    assert not [p for p in clients.ray_pids if Path(f"/proc/{p}").exists()
                and Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0] not in "ZX"]
    assert ray_like(descendants(os.getpid())) == []
    assert "FLWR_HOME" not in os.environ or os.environ["FLWR_HOME"] != str(clients._tmp / "flwr_home")


@pytest.mark.e2e
def test_cli_reports_a_failing_client_and_leaves_no_process(tmp_path, capsys):
    """A client that diverges inside an actor stops `fedguide run` with exit code 2, the client named."""
    from fedguide.cli import main

    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(tiny_raw(train={"rounds": 1, "lr": 1e12})))
    code = main(["run", str(tmp_path / "tiny.yaml"), "runtime.name=flower-sim", "runtime.workers=1", "--quiet",
                 "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2
    assert re.search(r"error: client \d failed in round 1:", err), err
    assert re.search(r"failed in round 1:\nclient \d diverged in round 1", err) and "fedguide resume" in err
    assert ray_like(descendants(os.getpid())) == []
