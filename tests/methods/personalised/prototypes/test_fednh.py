"""FedNH: spread prototype initialisation, the smoothed prototype update, the frozen cosine head,
the learnable scale, and end-to-end runs (learning, frozen zero bias, resume)."""
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from fedguide.config import TrainConfig
from fedguide.fl.setup import open_run, prepare
from fedguide.core.seeding import derive_seed
from fedguide.methods import METHODS, ClientContext
from fedguide.methods.personalised.prototypes.fednh import (PROTOTYPE_SEED_KEY, FedNH, FedNHParams, aggregate_class_means, cosine_logits,
                                    orthogonal_prototypes, smooth_prototypes, spread_prototypes)
from fedguide.models.split import SplitModel

from fedguide.fl.engine import TIMING_METRICS
from tests.tiny import Crash, crash_after, run_tiny
from tests.tiny import tiny_config as config

TIMING = TIMING_METRICS


def max_cos(p):
    return (F.normalize(p, dim=1) @ F.normalize(p, dim=1).T).fill_diagonal_(-2.0).max().item()


# ---- initialisation -----------------------------------------------------------------------------
@pytest.mark.parametrize("c, d", [(10, 16), (10, 64), (30, 8)])
def test_spread_prototypes_are_unit_and_better_spread_than_random(c, d):
    p = spread_prototypes(c, d, seed=0)
    assert p.shape == (c, d) and p.dtype == torch.float32
    assert torch.allclose(p.norm(dim=1), torch.ones(c), atol=1e-6)
    random = F.normalize(torch.randn(c, d, generator=torch.Generator().manual_seed(0)), dim=1)
    assert max_cos(p) < max_cos(random) - 0.05


def test_spread_prototypes_reach_the_simplex_when_c_le_d_plus_1():
    # C ≤ d+1 unit vectors: Σ_{i≠j} cos_ij = ‖Σ p_i‖² − C ≥ −C, so max cos ≥ −1/(C−1);
    # the regular simplex attains it.
    assert max_cos(spread_prototypes(10, 16, seed=3)) == pytest.approx(-1 / 9, abs=1e-3)
    assert max_cos(spread_prototypes(3, 2, seed=1)) == pytest.approx(-0.5, abs=1e-3)  # 120° apart on a circle


def test_spread_prototypes_seeded():
    assert torch.equal(spread_prototypes(10, 8, seed=5), spread_prototypes(10, 8, seed=5))
    assert not torch.equal(spread_prototypes(10, 8, seed=5), spread_prototypes(10, 8, seed=6))


def test_orthogonal_prototypes():
    p = orthogonal_prototypes(5, 8, seed=0)
    assert torch.allclose(p @ p.T, torch.eye(5), atol=1e-6)
    with pytest.raises(ValueError, match="init=spread"):
        orthogonal_prototypes(9, 8, seed=0)


# ---- server update -------------------------------------------------------------------------------
def test_smooth_prototypes_hand_computed():
    old = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    new = torch.tensor([[0.0, 1.0], [0.0, 0.0]])  # nobody holds class 1 this round
    out = smooth_prototypes(old, new, rho=0.7)
    # class 0: 0.7·[1, 0] + 0.3·[0, 1] = [0.7, 0.3], norm √0.58 -> [0.7, 0.3] / 0.761577
    assert torch.allclose(out[0], torch.tensor([0.7, 0.3]) / math.sqrt(0.58))
    assert torch.allclose(out[0], torch.tensor([0.919145, 0.393919]), atol=1e-6)
    assert torch.equal(out[1], old[1])  # kept
    assert torch.allclose(smooth_prototypes(old, new, rho=1.0), old)
    assert torch.allclose(smooth_prototypes(old, new, rho=0.0)[0], torch.tensor([0.0, 1.0]))
    assert torch.equal(smooth_prototypes(old, new, rho=0.0)[1], old[1])


def test_smooth_prototypes_with_short_mean():
    # A mean of unit features is shorter than 1: m = [0, 0.5]; 0.7·[1, 0] + 0.3·[0, 0.5] = [0.7, 0.15]
    out = smooth_prototypes(torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 0.5]]), rho=0.7)
    assert torch.allclose(out, torch.tensor([[0.7, 0.15]]) / math.hypot(0.7, 0.15))


def test_aggregate_class_means_hand_computed():
    a = torch.tensor([[0.6, 0.8], [0.0, 0.0]])
    b = torch.tensor([[0.0, 0.5], [1.0, 0.0]])
    counts = [torch.tensor([1, 0]), torch.tensor([3, 2])]
    # count-weighted: class 0 = (1·[0.6, 0.8] + 3·[0, 0.5]) / 4 = [0.15, 0.575]; class 1 = [1, 0]
    assert torch.allclose(aggregate_class_means([a, b], counts, normalize=False),
                          torch.tensor([[0.15, 0.575], [1.0, 0.0]]))
    # released code: client means normalised first ([0, 0.5] -> [0, 1]): (1·[0.6, 0.8] + 3·[0, 1]) / 4
    # = [0.15, 0.95], then normalised
    out = aggregate_class_means([a, b], counts, normalize=True)
    assert torch.allclose(out[0], torch.tensor([0.15, 0.95]) / math.hypot(0.15, 0.95))


def test_cosine_logits_hand_computed():
    z = torch.tensor([[3.0, 4.0]])
    protos = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    # cos = [3/5, 4/5]; times s = 2
    assert torch.allclose(cosine_logits(z, protos, 2.0), torch.tensor([[1.2, 1.6]]))


# ---- client side ---------------------------------------------------------------------------------
def small_model():
    torch.manual_seed(0)
    return SplitModel(nn.Sequential(nn.Linear(3, 4), nn.ReLU()), nn.Linear(4, 2), 4)


def test_local_loss_uses_frozen_cosine_head():
    model = small_model()
    x, y = torch.randn(5, 3), torch.tensor([0, 1, 1, 0, 1])
    method = FedNH(FedNHParams(scale=10.0), run=None)
    ctx = ClientContext(0, 1, None, {}, {})
    state = method.begin_local(model, ctx)
    loss = method.local_loss(model, x, y, ctx, state)
    cos = F.normalize(model.encoder(x), dim=1) @ F.normalize(model.head.weight, dim=1).T
    expected = F.cross_entropy(10.0 * cos, y)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    loss.backward()
    assert model.head.weight.grad is None and model.head.bias.grad is None  # nothing reaches the head
    assert model.encoder[0].weight.grad is not None


def fake_run(**train):
    return SimpleNamespace(train=TrainConfig(**train))


def test_learned_scale_takes_the_same_steps_as_a_joint_optimiser():
    x, y = torch.randn(6, 3, generator=torch.Generator().manual_seed(1)), torch.tensor([0, 1, 1, 0, 1, 0])
    train = {"lr": 0.1, "momentum": 0.9, "weight_decay": 1e-3}

    # Reference: s a parameter of the same SGD optimiser as the model.
    ref = small_model()
    s = nn.Parameter(torch.tensor(2.0))
    opt = torch.optim.SGD([*ref.parameters(), s], **train)
    for _ in range(3):
        cos = F.normalize(ref.encoder(x), dim=1) @ F.normalize(ref.head.weight, dim=1).T.detach()
        loss = F.cross_entropy(s * cos, y)
        opt.zero_grad()
        loss.backward()
        opt.step()

    # FedNH: the engine's optimiser sees the model only; s has its own, which the loop steps after the model's
    # (Method.local_optimizers), as the local loop does.
    model = small_model()
    method = FedNH(FedNHParams(learn_scale=True, scale=2.0), run=fake_run(**train))
    ctx = ClientContext(0, 1, None, {"scale": torch.tensor(2.0)}, {})
    state = method.begin_local(model, ctx)
    opt = torch.optim.SGD(model.parameters(), **train)
    for _ in range(3):
        loss = method.local_loss(model, x, y, ctx, state)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        for own in method.local_optimizers(ctx, state):
            own.step()
            own.zero_grad(set_to_none=True)
    assert state.scale.item() == pytest.approx(s.item(), rel=1e-6)
    assert s.item() != 2.0
    assert torch.allclose(model.encoder[0].weight, ref.encoder[0].weight, atol=1e-6)


def test_params_defaults_and_registry():
    p = FedNHParams()
    assert (p.rho, p.scale, p.learn_scale, p.init, p.normalize_means) == (0.7, 30.0, False, "spread", False)
    assert METHODS.get("fednh").obj is FedNH
    with pytest.raises(ValueError):
        FedNHParams(rho=1.5)
    with pytest.raises(ValueError):
        FedNHParams(scale=0)


# ---- end to end on 8x8 digits -----------------------------------------------------------------
def run(tmp_path, name, log=lambda s: None, resume=False, **over):
    return run_tiny(tmp_path, config(**over), name, resume, log)


def test_learns_with_unit_prototypes_and_zero_bias(tmp_path):
    summary, rows, run_dir = run(tmp_path, "a", method={"name": "fednh"})
    assert summary["final_accuracy"] > 0.5
    w = load_file(run_dir / "model.safetensors")
    assert torch.count_nonzero(w["head.bias"]) == 0
    assert torch.allclose(w["head.weight"].norm(dim=1), torch.ones(10), atol=1e-5)
    init = spread_prototypes(10, 64, derive_seed(1, "model", PROTOTYPE_SEED_KEY))
    assert not torch.allclose(w["head.weight"], init, atol=1e-3)  # the prototypes moved towards the data
    # Cosine argmax = the plain head's argmax when prototypes are unit and the bias is zero.
    ctx, _ = open_run(prepare(config(method={"name": "fednh"})), tmp_path / "x")
    global_w = load_file(run_dir / "checkpoints" / "last.safetensors")["global"]
    assert ctx.evaluator.evaluate(global_w)["accuracy"] == pytest.approx(rows[-1]["accuracy"])


def test_rho_one_keeps_the_initial_prototypes(tmp_path):
    _, _, run_dir = run(tmp_path, "uh", method={"name": "fednh", "rho": 1.0})
    w = load_file(run_dir / "model.safetensors")
    assert torch.allclose(w["head.weight"], spread_prototypes(10, 64, derive_seed(1, "model", PROTOTYPE_SEED_KEY)))
    assert torch.count_nonzero(w["head.bias"]) == 0


def test_learned_scale_is_server_state_and_resume_is_exact(tmp_path):
    over = {"method": {"name": "fednh", "learn_scale": True, "scale": 1.0}}
    ref, ref_rows, _ = run(tmp_path, "ref", **over)
    assert len({r["scale"] for r in ref_rows}) == 3 and all(r["scale"] != 1.0 for r in ref_rows)
    with pytest.raises(Crash):
        run(tmp_path, "crashed", log=crash_after(1), **over)
    resumed, rows, _ = run(tmp_path, "crashed", resume=True, **over)
    strip = lambda rs: [{k: v for k, v in r.items() if k not in TIMING} for r in rs]  # noqa: E731
    assert strip(rows) == strip(ref_rows)
    assert resumed["accuracy_curve"] == ref["accuracy_curve"]


def test_two_worker_processes_give_the_same_result(tmp_path):
    over = {"method": {"name": "fednh", "learn_scale": True}, "clients": {"num": 4, "per_round": 4}}
    _, one, _ = run(tmp_path, "w1", **over)
    _, two, _ = run(tmp_path, "w2", runtime={"workers": 2}, **over)
    strip = lambda rs: [{k: v for k, v in r.items() if k not in TIMING} for r in rs]  # noqa: E731
    assert strip(two) == strip(one)
