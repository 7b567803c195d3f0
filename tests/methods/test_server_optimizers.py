"""Server optimisers against their update rules on hand-computed numbers: FedAvgM (Hsu et al. 2019, Alg. 1) and
FedAdagrad / FedAdam / FedYogi (Reddi et al. 2021, "Adaptive federated optimization", Alg. 2, with m_{-1} = 0
and v_{-1} = tau^2); the bias-corrected form of Flower's FedAdam (flwr/server/strategy/fedadam.py, lines
175-187); and their place in a run: any method, BatchNorm statistics left to the aggregate, exact resume."""
from __future__ import annotations

import math

import pytest
import torch

from fedguide.core.server_updates import adaptive_step, avgm_step
from fedguide.fl.checkpoint import load_checkpoint
from fedguide.fl.setup import prepare
from fedguide.methods.server_optimizers import SERVER_OPTIMIZERS
from fedguide.registry import ConfigError
from tests.tiny import run_tiny, tiny_config

X = torch.tensor([1.0, 2.0], dtype=torch.float64)
AGG = torch.tensor([1.5, 1.0], dtype=torch.float64)  # delta = aggregate - x = [0.5, -1.0]


def test_fedavgm_accumulates_the_pseudo_gradient_with_momentum():
    # Step 1: v = delta = [0.5, -1]; x = x + 1.0 * v = [1.5, 1.0] (momentum has nothing to carry yet).
    x1, s1 = avgm_step(X, AGG, {}, lr=1.0, momentum=0.9)
    assert x1.tolist() == pytest.approx([1.5, 1.0])
    # Step 2 from x1 to an aggregate [2.0, 1.0]: delta = [0.5, 0]; v = 0.9 * [0.5, -1] + [0.5, 0] = [0.95, -0.9];
    # with lr 0.5: x = [1.5 + 0.475, 1.0 - 0.45] = [1.975, 0.55].
    x2, s2 = avgm_step(x1, torch.tensor([2.0, 1.0], dtype=torch.float64), s1, lr=0.5, momentum=0.9)
    assert s2["v"].tolist() == pytest.approx([0.95, -0.9])
    assert x2.tolist() == pytest.approx([1.975, 0.55])


def test_fedavgm_without_momentum_at_lr_one_is_the_aggregate():
    x1, _ = avgm_step(X, AGG, {"v": torch.tensor([3.0, 3.0], dtype=torch.float64)}, lr=1.0, momentum=0.0)
    assert torch.equal(x1, AGG)


# lr 0.1, beta1 0.9, beta2 0.99, tau 0.01: m = 0.1 * delta = [0.05, -0.1] for every rule, and
#   adam    v = 0.99 * 1e-4 + 0.01 * delta^2 = [0.002599, 0.010099]
#   adagrad v = 1e-4 + delta^2             = [0.2501, 1.0001]
#   yogi    v = 1e-4 - 0.01 * delta^2 * sign(1e-4 - delta^2) = 1e-4 + 0.01 * delta^2 = [0.0026, 0.0101]
# x = x + 0.1 * m / (sqrt(v) + 0.01); e.g. adam, first entry: 1 + 0.1 * 0.05 / (0.0509804 + 0.01) = 1.0819936.
@pytest.mark.parametrize("rule, v, x", [
    ("adam", [0.002599, 0.010099], [1.0819936, 1.9094972]),
    ("adagrad", [0.2501, 1.0001], [1.0098020, 1.9900995]),
    ("yogi", [0.0026, 0.0101], [1.0819804, 1.9095012]),
])
def test_adaptive_rules_take_the_first_step_of_reddi_et_al_alg_2(rule, v, x):
    x1, state = adaptive_step(rule, X, AGG, {}, t=1, lr=0.1, beta1=0.9, beta2=0.99, tau=0.01)
    assert state["m"].tolist() == pytest.approx([0.05, -0.1])
    assert state["v"].tolist() == pytest.approx(v)
    assert x1.tolist() == pytest.approx(x, abs=1e-7)


def test_yogi_lowers_v_where_it_exceeds_the_squared_pseudo_gradient():
    # v = [1.0, 0.01] against delta^2 = [0.25, 1.0]: entry 0 shrinks by 0.01 * 0.25, entry 1 grows by 0.01 * 1.0.
    state = {"m": torch.zeros(2, dtype=torch.float64), "v": torch.tensor([1.0, 0.01], dtype=torch.float64)}
    _, out = adaptive_step("yogi", X, AGG, state, t=2, lr=0.1, beta1=0.9, beta2=0.99, tau=0.01)
    assert out["v"].tolist() == pytest.approx([1.0 - 0.0025, 0.01 + 0.01])


def test_bias_correction_scales_the_step_as_kingma_and_ba():
    # At t = 1 the step is lr * sqrt(1 - 0.99) / (1 - 0.9) = 0.1 * 0.1 / 0.1 = 0.1 * 1.0; at t = 3 it is
    # 0.1 * sqrt(1 - 0.99^3) / (1 - 0.9^3) = 0.1 * 0.172340 / 0.271 = 0.0635940.
    plain, _ = adaptive_step("adam", X, AGG, {}, t=3, lr=0.1, beta1=0.9, beta2=0.99, tau=0.01)
    corrected, _ = adaptive_step("adam", X, AGG, {}, t=3, lr=0.1, beta1=0.9, beta2=0.99, tau=0.01,
                                 bias_correction=True)
    scale = math.sqrt(1 - 0.99 ** 3) / (1 - 0.9 ** 3)
    torch.testing.assert_close(corrected - X, (plain - X) * scale)
    assert scale == pytest.approx(0.635940, abs=1e-6)


def test_entries_outside_the_mask_take_the_aggregate():
    # A BatchNorm running variance must not be moved by an adaptive step (it could turn negative).
    mask = torch.tensor([True, False])
    x1, _ = adaptive_step("adam", X, AGG, {}, t=1, lr=0.1, beta1=0.9, beta2=0.99, tau=0.01, mask=mask)
    assert x1[0].item() == pytest.approx(1.0819936, abs=1e-7)
    assert x1[1].item() == 1.0


def test_a_mask_of_another_size_is_refused_with_a_sentence():
    opt = SERVER_OPTIMIZERS.get("adam").obj(SERVER_OPTIMIZERS.parse_params("adam", {}, "server_optimizer"),
                                            torch.ones(3, dtype=torch.bool))
    with pytest.raises(ConfigError, match="use server_optimizer.name=average with this method"):
        opt.step(torch.zeros(5), torch.ones(5))


def tiny(method="fedavg", rounds=3, **server):
    return tiny_config({"model": {"mapping": [32]}, "clients": {"per_round": 3}}, method={"name": method},
                       train={"rounds": rounds}, **({"server_optimizer": server} if server else {}))


def run(cfg, folder, resume=False):
    return run_tiny(folder.parent, cfg, folder.name, resume=resume)[0]


def test_avgm_without_momentum_reproduces_fedavg_and_adam_does_not(tmp_path):
    plain = run(tiny(), tmp_path / "plain")
    same = run(tiny(name="avgm", lr=1.0, momentum=0.0), tmp_path / "avgm0")
    adam = run(tiny(name="adam", lr=0.01), tmp_path / "adam")
    assert same["accuracy_curve"] == plain["accuracy_curve"]
    assert adam["accuracy_curve"] != plain["accuracy_curve"]
    assert (plain["method"], same["method"], adam["method"]) == ("fedavg", "fedavg+server_avgm", "fedavg+server_adam")


def test_a_server_optimiser_composes_with_another_method_and_resumes_exactly(tmp_path):
    cfg = dict(name="yogi", lr=0.02, bias_correction=True)
    full = run(tiny("fedprox", 3, **cfg), tmp_path / "full")
    run(tiny("fedprox", 2, **cfg), tmp_path / "cut")
    resumed = run(tiny("fedprox", 3, **cfg), tmp_path / "cut", resume=True)
    assert resumed["accuracy_curve"] == full["accuracy_curve"]
    a, b = (load_checkpoint(tmp_path / name / "checkpoints") for name in ("full", "cut"))
    assert {"server_optimizer.m", "server_optimizer.v", "server_optimizer.t"} <= set(a.method_state)
    assert int(a.method_state["server_optimizer.t"]) == 3
    for key in ("server_optimizer.m", "server_optimizer.v"):
        assert torch.equal(a.method_state[key], b.method_state[key])


def test_unknown_server_optimiser_and_parameter_are_named():
    with pytest.raises(ConfigError, match="unknown server optimizer 'adma'.*adam"):
        prepare(tiny(name="adma"))
    with pytest.raises(ConfigError, match="server_optimizer.beta3: server optimizer 'adam' has no parameter 'beta3'"):
        prepare(tiny(name="adam", beta3=0.9))
