"""The simulated device (core/simulated.py): each kind of mistake CUDA would refuse or pay for is planted and
shown to be caught or counted; whole runs under it compute what the CPU computes."""
from __future__ import annotations

import contextlib
import dataclasses
import os

import pytest
import torch
import torch.nn.functional as F

from fedguide.core import simulated
from fedguide.core.device import deterministic, resolve_device
from fedguide.core.simulated import SIMULATED, DeviceMixError, SimulatedDevice
from fedguide.fl.setup import check_deterministic, prepare
from fedguide.methods import METHODS
from fedguide.registry import ConfigError
from fedguide.methods.classic.fedavg import FedAvg
from tests.tiny import run_tiny, tiny_config, without_timing


def test_the_device_is_resolved_by_name():
    assert resolve_device("simulated") == SIMULATED
    assert SIMULATED != torch.device("cpu")


def test_mixing_a_device_tensor_with_a_host_tensor_raises_with_the_op_and_the_line():
    with SimulatedDevice():
        on = torch.ones(3, device=SIMULATED)
        with pytest.raises(DeviceMixError, match=r"aten\.add\.Tensor mixes device.*test_simulated_device\.py:\d+"):
            on + torch.ones(3)
        with pytest.raises(DeviceMixError, match="aten.mm"):
            torch.ones(2, 3, device=SIMULATED) @ torch.ones(3, 2)


def test_tensors_inside_lists_and_every_output_of_an_op_are_seen():
    assert simulated.tensors_in((1, [torch.zeros(1), (torch.ones(1),)]), {"out": torch.ones(2), "k": {}})[2].shape == (2,)
    with SimulatedDevice() as sim:
        on = torch.ones(2, 3, device=SIMULATED)
        with pytest.raises(DeviceMixError, match=r"aten\.cat"):  # the host tensor is the list's second item
            torch.cat([on, torch.ones(2, 3)])
        values, indices = on.max(dim=1)  # a structseq of two outputs: both live on the device
        assert sim.on_device(values) and sim.on_device(indices)
        assert all(sim.on_device(t) for t in torch.split(on, 1))


def test_a_zero_dim_host_tensor_is_a_scalar_and_may_mix():
    with SimulatedDevice() as sim:
        out = torch.ones(3, device=SIMULATED) * torch.tensor(2.0)
        assert sim.on_device(out) and out.tolist() == [2.0, 2.0, 2.0]
        with pytest.raises(DeviceMixError):  # a device scalar with a host vector is not: CUDA refuses it
            torch.tensor(2.0, device=SIMULATED) * torch.ones(3)


def test_indexing_follows_cuda_host_indices_are_copied_device_indices_into_host_refused():
    with SimulatedDevice() as sim:
        on = torch.arange(10.0, device=SIMULATED)
        before = sim.counters.h2d_bytes
        picked = on[torch.tensor([1, 2, 3])]
        assert sim.on_device(picked) and sim.counters.h2d_bytes - before == 3 * 8
        with pytest.raises(DeviceMixError, match="aten.index"):
            torch.arange(10.0)[torch.tensor([1], device=SIMULATED)]
        with pytest.raises(DeviceMixError):  # values from the host into a device tensor
            on[torch.tensor([0, 1])] = torch.tensor([5.0, 6.0])


def test_every_route_to_the_device_counts_its_bytes():
    host = torch.zeros(4, 4)  # 64 bytes
    with SimulatedDevice() as sim:
        routes = [lambda: host.to(SIMULATED), lambda: host.cuda(), lambda: host.to("cpu:0"),
                  lambda: torch.as_tensor(host, device=SIMULATED), lambda: torch.tensor(host.tolist(), device=SIMULATED),
                  lambda: torch.empty(4, 4, device=SIMULATED).copy_(host)]
        for route in routes:
            before = sim.counters.h2d_bytes
            out = route()
            assert sim.on_device(out) and not sim.on_device(host)
            assert sim.counters.h2d_bytes - before == 64
        # made on the device: nothing crosses
        before = sim.counters.h2d_bytes
        torch.zeros(4, 4, device=SIMULATED)
        assert sim.counters.h2d_bytes == before


def test_reads_of_device_values_on_the_host_are_counted_as_syncs():
    with SimulatedDevice() as sim:
        on = torch.arange(4.0, device=SIMULATED)
        reads = [lambda: on.sum().item(), lambda: float(on.sum()), lambda: bool(on.sum() > 0), lambda: on.tolist(),
                 lambda: on.cpu(), lambda: on[on > 1], lambda: on.nonzero(), lambda: torch.equal(on, on)]
        for read in reads:
            before = sim.counters.host_syncs
            read()
            assert sim.counters.host_syncs == before + 1
        back = on.cpu()
        assert not sim.on_device(back) and sim.on_device(on)
        with pytest.raises(TypeError, match="numpy"):
            on.numpy()


def test_device_tensors_say_where_they_are_so_device_of_idioms_work():
    with SimulatedDevice() as sim:
        on = torch.ones(2, device=SIMULATED)
        assert on.device == SIMULATED and torch.ones(1).device == torch.device("cpu")
        assert sim.on_device(torch.arange(3, device=on.device)) and sim.on_device(torch.zeros_like(on))
        assert sim.on_device(on.new_tensor([1.0])) and sim.on_device(on[:1]) and sim.on_device(on.data)


def test_training_on_the_device_computes_what_the_cpu_computes_and_syncs_nothing_per_step():
    def train(device_rules):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
                                    torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 3))
        x, y = torch.randn(8, 1, 8, 8), torch.randint(0, 3, (8,))
        with device_rules as sim:
            device = SIMULATED if sim is not None else torch.device("cpu")
            model.to(device)
            x, y = x.to(device), y.to(device)
            opt = torch.optim.Adam(model.parameters(), lr=0.01)
            for _ in range(3):
                with simulated.step():
                    loss = F.cross_entropy(model(x), y)
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
            if sim is not None:
                assert all(sim.on_device(p) and sim.on_device(p.grad) for p in model.parameters())
                assert sim.counters.steps == 3 and sim.counters.step_host_syncs == 0
            return [p.detach().cpu().clone() for p in model.parameters()]

    on_cpu = train(contextlib.nullcontext())
    on_sim = train(SimulatedDevice())
    assert all(torch.equal(a, b) for a, b in zip(on_cpu, on_sim))


def test_syncs_and_copies_inside_a_step_are_counted_per_step():
    with SimulatedDevice() as sim:
        on = torch.ones(3, device=SIMULATED)
        for _ in range(2):
            with simulated.step():
                on.sum().item()
                on + torch.ones(3).to(SIMULATED)
        on.sum().item()  # outside a step: counted in the total only
        assert (sim.counters.steps, sim.counters.step_host_syncs, sim.counters.step_h2d_bytes) == (2, 2, 24)
        assert sim.counters.host_syncs == 3
        summary = simulated.device_check_summary(sim.counters)
        assert summary["host_syncs_per_step"] == 1.0 and summary["h2d_bytes_per_step"] == 12.0
        # the steps' copies are traced to their line, here this test's: 12 bytes a step, twice
        ((where, nbytes),) = summary["h2d_step_sites"].items()
        assert "test_simulated_device.py" in where and "torch.ones(3).to(SIMULATED)" in where and nbytes == 24
        # counters from two places (the worker pool's) add up, sites too; since() takes them back off
        before = sim.counters.copy()
        sim.counters.add(before)
        assert sim.counters.step_h2d_sites == {where: 48} and sim.counters.since(before).step_h2d_sites == {where: 24}
        assert sim.counters.since(sim.counters).step_h2d_sites == {} and sim.counters.since(before).steps == 2


class HostBatches(FedAvg):
    """A planted mistake: the method's own pass reads the client's host tensors (not ctx.batch)."""

    def client_upload(self, model, ctx, state):
        model(ctx.data.x[ctx.data.indices[:4]])
        return super().client_upload(model, ctx, state)


def test_a_method_feeding_host_data_to_the_device_model_fails_naming_its_line(tmp_path, monkeypatch):
    monkeypatch.setitem(METHODS._entries, "fedavg", dataclasses.replace(METHODS.get("fedavg"), obj=HostBatches))
    cfg = tiny_config(train={"rounds": 1, "device": "simulated"})
    with pytest.raises(DeviceMixError, match=r"test_simulated_device\.py:\d+ in client_upload"):
        run_tiny(tmp_path, cfg)


def test_a_run_on_the_simulated_device_repeats_the_cpu_run_and_reports_its_check(tmp_path):
    cpu, cpu_rows, _ = run_tiny(tmp_path, tiny_config(train={"rounds": 2, "device": "cpu"}), "cpu")
    sim, sim_rows, _ = run_tiny(tmp_path, tiny_config(train={"rounds": 2, "device": "simulated"}), "sim")
    assert without_timing(sim_rows) == without_timing(cpu_rows)
    assert "device_check" not in cpu
    check = sim["device_check"]
    assert check["device"] == "simulated" and check["mixes"] == 0 and check["steps"] > 0
    assert check["host_syncs_per_step"] == 0 and check["h2d_bytes_per_step"] == 0


def test_an_op_without_a_deterministic_cuda_kernel_raises_under_deterministic_algorithms():
    with SimulatedDevice(), deterministic(True):
        image = torch.rand(1, 1, 4, 4, device=SIMULATED).requires_grad_()
        out = F.interpolate(image, size=(8, 8), mode="bilinear", align_corners=False)
        with pytest.raises(RuntimeError, match="upsample_bilinear2d_backward.*no deterministic CUDA"):
            out.sum().backward()
        with pytest.raises(RuntimeError, match="cumsum"):
            torch.ones(3, device=SIMULATED).cumsum(0)
        torch.ones(3, dtype=torch.long, device=SIMULATED).cumsum(0)  # integer cumsum is deterministic


@pytest.mark.parametrize("override, names", [
    ({"train": {"augment": "autoaugment"}}, "train.augment: autoaugment"),
    ({"method": {"name": "fedcado"}}, "method.ce_loss=false"),
])
def test_deterministic_settings_cuda_cannot_honour_are_refused_before_the_run(override, names):
    base = {"data": {"name": "standin", "like": "cifar10", "scale": 0.002}, "model": {"name": "cnn"}} \
        if "train" in override else {}
    cfg = tiny_config(base, {"train": {"device": "simulated", "deterministic": True}}, override)
    with pytest.raises(ConfigError, match=f"train.deterministic: true on a GPU.*{names}"):
        prepare(cfg)
    ok = tiny_config(base, {"train": {"device": "cpu", "deterministic": True}}, override)
    check_deterministic(ok, torch.nn.Linear(1, 1), METHODS.get(ok.method.name).obj, None)  # the CPU has kernels


def test_the_cublas_workspace_is_set_when_fedguide_is_imported():
    assert os.environ.get("CUBLAS_WORKSPACE_CONFIG") in (":4096:8", ":16:8")


def test_auto_workers_on_a_gpu_is_one_process_per_gpu():
    from fedguide.fl.runtimes.local import LocalParams, resolve_workers

    assert resolve_workers(LocalParams(workers="auto"), 10, 1000, cores=16, device=SIMULATED)[0] == 1
    assert resolve_workers(LocalParams(workers="auto"), 10, 1000, cores=16, device=torch.device("cpu"))[0] == 10
    assert resolve_workers(LocalParams(workers=3), 10, 1000, cores=16, device=SIMULATED)[0] == 3  # asked for


def test_processes_sharing_the_device_follow_one_decision_of_the_server(tmp_path, monkeypatch):
    from fedguide.core.device import SIMULATED_FREE_BYTES
    from fedguide.data.device_data import bytes_needed
    from fedguide.fl.setup import client_processes_on_device, open_run

    cfg = tiny_config(train={"device": "simulated"})
    prepared = prepare(cfg)
    need = bytes_needed(prepared.data.splits)
    monkeypatch.setenv(SIMULATED_FREE_BYTES, str(int(need * 2.5)))  # one copy fits (half is headroom), two do not
    with SimulatedDevice():
        ctx, _ = open_run(prepared, tmp_path / "a")
        assert ctx.device_data.on_device
        assert client_processes_on_device(ctx, 1) is None  # the server alone: its own decision
        assert client_processes_on_device(ctx, 2) == "0"  # two more copies do not fit: every worker keeps the host
        monkeypatch.setenv(SIMULATED_FREE_BYTES, str(need * 10))
        assert client_processes_on_device(ctx, 2) == "1"
        forced = prepare(tiny_config(train={"device": "simulated"}, data={"name": "digits", "on_device": True}))
        ctx, _ = open_run(forced, tmp_path / "b")
        monkeypatch.setenv(SIMULATED_FREE_BYTES, str(need))
        with pytest.raises(ConfigError, match="for 2 processes.*runtime.workers"):
            client_processes_on_device(ctx, 2)


def test_a_pool_whose_copies_do_not_fit_keeps_the_data_on_the_host_and_computes_the_same(tmp_path, monkeypatch):
    from fedguide.core.device import SIMULATED_FREE_BYTES
    from fedguide.data.device_data import bytes_needed

    cfg = tiny_config(train={"rounds": 1, "device": "simulated"}, runtime={"workers": 2, "threads_per_worker": 1})
    need = bytes_needed(prepare(cfg).data.splits)
    monkeypatch.setenv(SIMULATED_FREE_BYTES, str(int(need * 2.5)))
    _, sim_rows, _ = run_tiny(tmp_path, cfg, "pool")
    _, cpu_rows, _ = run_tiny(tmp_path, tiny_config(train={"rounds": 1}), "cpu")
    assert without_timing(sim_rows) == without_timing(cpu_rows)
    assert "FEDGUIDE_DATA_ON_DEVICE" not in os.environ  # the decision lived as long as the run


def test_fedcda_selects_across_rounds_on_the_device_as_on_the_cpu(tmp_path):
    # Round 2 on: its remembered models come back from the (host) server store, and after the warm-up the Gram
    # matrix of the candidates is computed where they are.
    method = {"name": "fedcda", "warmup_rounds": 1, "memory": 2}
    _, cpu, _ = run_tiny(tmp_path, tiny_config(method=method, train={"rounds": 3}), "cpu")
    _, sim, _ = run_tiny(tmp_path, tiny_config(method=method, train={"rounds": 3, "device": "simulated"}), "sim")
    assert without_timing(sim) == without_timing(cpu)
    assert all("fedcda_mean_age" in r for r in cpu)
