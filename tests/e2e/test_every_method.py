"""Every registered method end to end once on each runtime the suite runs every method on, at the smallest size
that exercises its paths (8x8 digits, six clients, three rounds): in process on the CPU, where it learns; in a
pool of two worker processes on the simulated device (the CPU under CUDA's rules: the server's aggregation and
state on the device in this process, the clients' steps in the workers), where it computes the same numbers;
and on both Flower runtimes through an in-process Grid (tests/fl/runtimes/flower/loopback.py): flower-sim's
messages, record codec and client step without Ray's processes, and a deployment with every client in a folder
of its own, where it computes the same numbers again (or, where its settings need every client on the server,
is refused naming the setting). Methods built on a guidance model run end to end in their own tests
(tests/methods/) and on the simulated device in tests/methods/test_guided_simulated.py; SCAFFOLD and a failing
client cross Ray's actors in tests/fl/runtimes/flower/test_simulation.py, FedAvg a real SuperLink and SuperNodes
in tests/fl/runtimes/flower/test_deployment.py; the CLI on real Fashion-MNIST in tests/e2e/test_cli.py."""
from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

from fedguide.fl.runtimes.flower.server import deployed_experiment
from fedguide.fl.setup import prepare
from fedguide.methods import METHODS
from fedguide.methods.compose import REGULARIZERS
from fedguide.registry import ConfigError
from tests.fl.runtimes.flower.loopback import deployed_clients, simulation_without_ray
from tests.fl.runtimes.flower.test_deployment import deployed_rows, read_rows
from tests.fl.test_workers import assert_identical, config, run
from tests.tiny import GUIDED_METHODS

# Settings that let a method's own path run in three rounds: FedCDA aggregates by plain FedAvg for its first
# 50 rounds, which would leave its cross-round selection unexercised.
REACH_THE_METHODS_PATH = {"fedcda": {"warmup_rounds": 1},
                          # Per-FedAvg's released meta step is plain SGD at β 1e-3, too small to learn in three
                          # rounds here; the run's learning rate reaches the same path.
                          "perfedavg": {"beta": 0.05}}
# Methods whose every optimiser step is asserted free of host syncs on the simulated device (a loss summed on the
# device is fine; one read per step is not).
# Methods whose defaults need every client's data and state on the server, which a deployment refuses with the
# setting to change.
SERVER_HOLDS_EVERY_CLIENT = {"fedala": "write method.ala_clients: participants"}
# Chance is 10 %; three rounds of two epochs (batches of 64: half the steps of 32, and the simulated device's cost
# is per op) on six digit clients reach 0.33 (SCAFFOLD, its control variates starting at zero) to 0.96
# (centralized), on the global test set or, for a personalised method, on its clients' own splits.
LEARNS = 0.3

PLAIN = [n for n in METHODS.names() if n not in GUIDED_METHODS]
CASES = PLAIN + ["fedavg+dw"]


def required_model(name: str, regs: list[str]) -> dict:
    """The model settings the method and its regularisers refuse to run without (FedDW's bias-free head)."""
    needs = dict(METHODS.get(name).obj.model_requirements)
    for reg in regs:
        needs.update(REGULARIZERS.get(reg).obj.model_requirements)
    return needs


@pytest.mark.e2e
@pytest.mark.parametrize("method", CASES)
def test_every_method_learns_and_computes_alike_in_process_on_the_simulated_device_in_workers_and_on_flower(
        tmp_path, monkeypatch, method):
    # Payloads and uploads are plain records, so a method gives the same result in worker processes and through
    # Flower's records, deployed or simulated; and on the simulated device it computes what the CPU computes.
    name, regs = (method.split("+")[0], [method.split("+")[1]]) if "+" in method else (method, [])
    entry = METHODS.get(name).obj
    over = dict(train={"rounds": 3, "epochs": 2, "batch_size": 64, "lr": 0.05}, regularizers=regs,
                model={"name": "mlp", **required_model(name, regs)},
                eval={"mode": "both" if entry.personal_evaluation else "global"})
    section = {"name": name, **REACH_THE_METHODS_PATH[name]} if name in REACH_THE_METHODS_PATH else name
    cpu = run(tmp_path, "w1", config(1, section, **over))
    rows = cpu[0]
    learned = max(max(r.get("accuracy") or 0.0, r.get("personal_accuracy") or 0.0) for r in rows)
    assert learned > LEARNS, [(r.get("accuracy"), r.get("personal_accuracy")) for r in rows]
    sim_over = {**over, "train": {**over["train"], "device": "simulated"}}
    assert_identical(cpu, run(tmp_path, "w2", config(2, section, **sim_over)), (method, "workers, simulated"))
    check = json.loads((tmp_path / "w2" / "summary.json").read_text())["device_check"]
    assert check["device"] == "simulated" and check["mixes"] == 0
    # every method: a step neither waits for the device nor copies from the host (the summary names any line that does)
    assert check["host_syncs_per_step"] == 0 and check["h2d_bytes_per_step"] == 0, check
    if name == "fedcda":
        assert "fedcda_mean_age" in rows[-1], rows[-1]  # its cross-round selection ran
    grids = simulation_without_ray(monkeypatch)
    flower = {**over, "runtime": {"name": "flower-sim", "workers": 1, "threads_per_worker": 1}}
    assert_identical(cpu, run(tmp_path, "flower", config(1, section, **flower)), (method, "flower-sim"))
    (grid,) = grids
    assert grid.trains() == sum(len(r["clients"]) for r in rows)
    # Deployed: each client in a folder of its own, its state there, the server holding none.
    cfg = config(1, section, **{**over, "runtime": {"name": "flower", "workers": 1, "threads_per_worker": 1}})
    grid = deployed_clients(monkeypatch, tmp_path / "machines", cfg)
    deployed_run = deployed_experiment(prepare(cfg), tmp_path / "deployed", grid, log=lambda s: None)
    if name in SERVER_HOLDS_EVERY_CLIENT:
        with pytest.raises(ConfigError, match=SERVER_HOLDS_EVERY_CLIENT[name]):
            deployed_run.run()
        return
    deployed_run.run()
    deployed = deployed_rows(read_rows(tmp_path / "deployed"))
    assert_identical((deployed_rows(rows), cpu[1]),
                     (deployed, load_file(tmp_path / "deployed" / "model.safetensors")), (method, "deployed"))
    assert not (tmp_path / "deployed" / "client_state").exists()
