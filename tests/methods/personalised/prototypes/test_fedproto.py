"""FedProto: prototype aggregation (Eq. 6), the prototype regulariser, nearest-prototype inference,
and end-to-end runs with shared and with private (paper-literal) weights."""

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from fedguide.data.federated import ClientData
from fedguide.fl.setup import open_run, prepare
from fedguide.core.state import ClientStateStore
from fedguide.methods import METHODS, ClientContext
from fedguide.methods.personalised.prototypes.fedproto import (FedProto, FedProtoParams, aggregate_prototypes, class_feature_means,
                                       nearest_prototype, prototype_loss)
from fedguide.models.split import SplitModel

from fedguide.fl.engine import TIMING_METRICS
from tests.tiny import Crash, crash_after, run_tiny
from tests.tiny import tiny_config as config

TIMING = TIMING_METRICS


# ---- aggregation (Eq. 6) ------------------------------------------------------------------------
def test_aggregate_prototypes_count_weighted_hand_computed():
    a = torch.tensor([[1.0, 2.0], [0.0, 0.0], [3.0, 3.0], [0.0, 0.0]])
    b = torch.tensor([[3.0, 4.0], [5.0, 5.0], [0.0, 0.0], [0.0, 0.0]])
    protos, total = aggregate_prototypes([a, b], [torch.tensor([1, 0, 2, 0]), torch.tensor([3, 1, 0, 0])])
    # class 0: N = 1 + 3 = 4, (1·[1, 2] + 3·[3, 4]) / 4 = [10/4, 14/4] = [2.5, 3.5]
    # class 1: only b holds it: [5, 5];  class 2: only a: [3, 3];  class 3: nobody -> zero row, N = 0
    expected = torch.tensor([[2.5, 3.5], [5.0, 5.0], [3.0, 3.0], [0.0, 0.0]])
    assert torch.allclose(protos, expected)
    assert total.tolist() == [4.0, 1.0, 2.0, 0.0]
    assert protos.dtype == torch.float32 and torch.isfinite(protos).all()


def test_aggregate_prototypes_uniform_weights_is_plain_mean():
    a, b = torch.tensor([[0.0, 0.0]]), torch.tensor([[4.0, 2.0]])
    protos, _ = aggregate_prototypes([a, b], [torch.tensor([1.0]), torch.tensor([1.0])])
    assert torch.allclose(protos, torch.tensor([[2.0, 1.0]]))  # ([0,0] + [4,2]) / 2


def test_aggregate_prototypes_rejects_bad_input():
    with pytest.raises(ValueError):
        aggregate_prototypes([], [])
    with pytest.raises(ValueError):
        aggregate_prototypes([torch.zeros(1, 2)], [torch.tensor([1]), torch.tensor([1])])
    with pytest.raises(ValueError):
        aggregate_prototypes([torch.zeros(1, 2)], [torch.tensor([-1])])


# ---- the regulariser --------------------------------------------------------------------------
def reg_case():
    z = torch.tensor([[1.0, 1.0], [2.0, 0.0], [0.0, 3.0]], requires_grad=True)
    y = torch.tensor([0, 1, 2])
    protos = torch.tensor([[0.0, 1.0], [2.0, 2.0], [9.0, 9.0]])
    present = torch.tensor([True, True, False])
    return z, y, protos, present


def test_prototype_loss_hand_computed():
    z, y, protos, present = reg_case()
    # sample 0: ‖[1,1] − [0,1]‖² = 1;  sample 1: ‖[2,0] − [2,2]‖² = 4;  sample 2: class 2 has no prototype -> 0
    # (1 + 4 + 0) / |B| = 5 / 3
    assert prototype_loss(z, y, protos, present).item() == pytest.approx(5 / 3)
    # released-code reduction divides every squared distance by d = 2 as well: (0.5 + 2) / 3
    assert prototype_loss(z, y, protos, present, "mean").item() == pytest.approx(2.5 / 3)


def test_prototype_loss_gradient_hand_computed():
    z, y, protos, present = reg_case()
    prototype_loss(z, y, protos, present).backward()
    # d/dz_i (1/B)‖z_i − p‖² = 2(z_i − p)/B: [2/3, 0], [0, −4/3]; the sample without prototype gets 0
    assert torch.allclose(z.grad, torch.tensor([[2 / 3, 0.0], [0.0, -4 / 3], [0.0, 0.0]]))


def test_prototype_loss_without_prototypes_is_zero():
    z, y, protos, _ = reg_case()
    assert prototype_loss(z, y, protos, torch.zeros(3, dtype=torch.bool)).item() == 0.0


def test_nearest_prototype_skips_missing_classes():
    z = torch.tensor([[0.0, 0.0], [5.0, 5.0], [0.4, 0.0]])
    protos = torch.tensor([[1.0, 0.0], [4.0, 4.0], [0.0, 0.0]])
    present = torch.tensor([True, True, False])
    # class 2's prototype sits exactly on z_0 but does not exist yet: z_0 -> class 0 (distance 1)
    assert nearest_prototype(z, protos, present).tolist() == [0, 1, 0]
    assert nearest_prototype(z, protos, torch.ones(3, dtype=torch.bool)).tolist() == [2, 1, 2]


def identity_model(d=2, c=3):
    return SplitModel(nn.Identity(), nn.Linear(d, c), d)


def test_class_feature_means_batched_hand_computed():
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0]])
    y = torch.tensor([0, 0, 2, 1])
    data = ClientData(0, torch.tensor([0, 1, 2]), x, y, 3)  # sample 3 belongs to another client
    fetch = lambda idx: (x[idx], y[idx])  # noqa: E731  (ClientContext.batch on the host)
    means, counts = class_feature_means(identity_model(), data, 2, fetch)
    # class 0: ([1,2] + [3,4]) / 2 = [2, 3];  class 1: none here -> 0;  class 2: [5, 6]
    assert torch.allclose(means, torch.tensor([[2.0, 3.0], [0.0, 0.0], [5.0, 6.0]]))
    assert counts.tolist() == [2, 0, 1]
    normed, _ = class_feature_means(identity_model(), data, 1, fetch, normalize=True)
    # ([1,2]/√5 + [3,4]/5) / 2
    expected0 = (torch.tensor([1.0, 2.0]) / 5 ** 0.5 + torch.tensor([0.6, 0.8])) / 2
    assert torch.allclose(normed[0], expected0)


# ---- the local objective ----------------------------------------------------------------------
def test_local_loss_is_ce_plus_lambda_times_regulariser():
    torch.manual_seed(0)
    model = identity_model()
    x, y = torch.tensor([[1.0, 1.0], [2.0, 0.0], [0.0, 3.0]]), torch.tensor([0, 1, 2])
    _, _, protos, present = reg_case()
    method = FedProto(FedProtoParams(lam=0.5, reg_reduction="sum"), run=None)
    ctx = ClientContext(0, 2, None, {"protos": protos, "proto_present": present}, {})
    state = method.begin_local(model, ctx)
    ce = F.cross_entropy(model(x), y).item()
    assert method.local_loss(model, x, y, ctx, state).item() == pytest.approx(ce + 0.5 * 5 / 3, rel=1e-6)
    # Round 1: no global prototype yet, the loss is plain cross-entropy.
    none_yet = {"protos": torch.zeros(3, 2), "proto_present": torch.zeros(3, dtype=torch.bool)}
    first = ClientContext(0, 1, None, none_yet, {})
    assert method.local_loss(model, x, y, first, method.begin_local(model, first)).item() == pytest.approx(ce, rel=1e-6)


def test_params_defaults_and_registry():
    p = FedProtoParams()
    assert (p.lam, p.share_weights, p.weighting, p.reg_reduction) == (1.0, True, "count", "mean")
    assert METHODS.get("fedproto").obj is FedProto
    with pytest.raises(ValueError):
        FedProtoParams(lam=-1)
    with pytest.raises(ValueError):
        FedProtoParams(reg_reduction="max")


# ---- end to end on 8x8 digits -----------------------------------------------------------------
def run(tmp_path, name, log=lambda s: None, resume=False, **over):
    return run_tiny(tmp_path, config(**over), name, resume, log)


def checkpoint_state(run_dir):
    with safe_open(str(run_dir / "checkpoints" / "last.safetensors"), framework="pt") as fh:
        return {k: fh.get_tensor(k) for k in fh.keys()}


def test_shared_weights_learns_and_reports_both_accuracies(tmp_path):
    summary, rows, run_dir = run(tmp_path, "a", method={"name": "fedproto"})
    assert summary["final_accuracy"] > 0.5
    assert all(0.0 <= r["head_accuracy"] <= 1.0 for r in rows)
    state = checkpoint_state(run_dir)
    protos, present = state["method.protos"], state["method.present"]
    assert protos.shape == (10, 64) and present.all()  # 2 clients per round reach every digit in 3 rounds
    # Down: weights + prototypes (10·64 floats) + presence mask (10 bools) per client; up adds counts.
    n_weights = state["global"].numel()
    assert rows[0]["bytes_down"] == 2 * (4 * n_weights + 4 * 640 + 10)
    assert rows[0]["bytes_up"] == 2 * (4 * n_weights + 4 * 640 + 8 * 10 + 8)


def test_private_weights_keep_one_model_per_client(tmp_path):
    over = {"method": {"name": "fedproto", "share_weights": False}, "clients": {"num": 4, "per_round": 4},
            "train": {"epochs": 3}}
    summary, rows, run_dir = run(tmp_path, "p", **over)
    assert all(r["bytes_down"] == 4 * (4 * 640 + 10) for r in rows)  # only prototypes travel down
    store = ClientStateStore(run_dir / "client_state")
    states = [store.get(c) for c in range(4)]
    assert all("weights" in s for s in states)
    assert not torch.equal(states[0]["weights"], states[1]["weights"])
    # Recompute the reported mean accuracy from the stored client models and the checkpointed prototypes.
    ctx, _ = open_run(prepare(config(**over)), tmp_path / "scratch")
    state = checkpoint_state(run_dir)
    accs = []
    for s in states:
        z, _, y = ctx.evaluator.features(s["weights"])
        pred = nearest_prototype(z, state["method.protos"], state["method.present"])
        accs.append(float((pred == y).float().mean()))
    assert rows[-1]["accuracy"] == pytest.approx(sum(accs) / 4)
    assert rows[-1]["client_accuracy_min"] == pytest.approx(min(accs))
    assert summary["final_accuracy"] > 0.3  # each client model sees a skewed quarter of the digits


@pytest.mark.parametrize("share", [True, False])
def test_resume_reproduces_an_uninterrupted_run(tmp_path, share):
    over = {"method": {"name": "fedproto", "share_weights": share}}
    ref, ref_rows, _ = run(tmp_path, "ref", **over)
    with pytest.raises(Crash):
        run(tmp_path, "crashed", log=crash_after(2), **over)
    resumed, rows, _ = run(tmp_path, "crashed", resume=True, **over)
    assert resumed["accuracy_curve"] == ref["accuracy_curve"]
    strip = lambda rs: [{k: v for k, v in r.items() if k not in TIMING} for r in rs]  # noqa: E731
    assert strip(rows) == strip(ref_rows)


def test_two_worker_processes_give_the_same_result(tmp_path):
    # Client hooks run in other processes: nothing per client may live in the Method object.
    over = {"method": {"name": "fedproto", "share_weights": False}, "clients": {"num": 4, "per_round": 4}}
    _, one, _ = run(tmp_path, "w1", **over)
    _, two, _ = run(tmp_path, "w2", runtime={"workers": 2}, **over)
    strip = lambda rs: [{k: v for k, v in r.items() if k not in TIMING} for r in rs]  # noqa: E731
    assert strip(two) == strip(one)
