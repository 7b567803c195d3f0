"""FedDistill+: the released form (liuvvvvv1/FedDW Updata.py lines 194-257, main.py lines 178-238) and PFLlib's
form on hand-computed tensors, the clients' collections, and a run composed with FedDW's regulariser (FedDW
Table IV)."""
import math

import pytest
import torch
import torch.nn.functional as F

from fedguide.methods.classic.feddistill_plus import (aggregate_class_logits, aggregate_released, distill_term,
                                                       released_term)
from tests.methods.pfl_cases import client_round, opened
from tests.tiny import run_tiny, tiny_config


def test_distill_term_is_mse_against_the_labels_global_logits():
    logits = torch.tensor([[1.0, 2.0], [0.0, 0.0], [3.0, -1.0]])
    labels = torch.tensor([0, 1, 1])
    class_logits = torch.tensor([[0.0, 2.0], [1.0, 1.0]])
    known = torch.tensor([True, True])
    # squared errors: sample 0: (1-0)^2 + 0 = 1; sample 1: 1 + 1 = 2; sample 2: 4 + 4 = 8 -> 11 / (3*2)
    assert distill_term(logits, labels, class_logits, known).item() == pytest.approx(11 / 6)


def test_samples_of_a_class_without_a_global_logit_add_nothing_but_count_in_the_mean():
    logits = torch.tensor([[1.0, 2.0], [0.0, 0.0], [3.0, -1.0]])
    labels = torch.tensor([0, 1, 1])
    class_logits = torch.tensor([[0.0, 2.0], [1.0, 1.0]])
    value = distill_term(logits, labels, class_logits, torch.tensor([True, False]))
    assert value.item() == pytest.approx(1 / 6)  # only sample 0's error, over all 6 entries (nn.MSELoss)


def test_global_logits_average_the_clients_holding_each_class():
    c = 3
    means = [torch.tensor([[1.0, 0, 0], [0, 2.0, 0], [0, 0, 0]]),
             torch.tensor([[3.0, 0, 0], [0, 0, 0], [0, 0, 6.0]])]
    counts = [torch.tensor([1.0, 4.0, 0.0]), torch.tensor([3.0, 0.0, 2.0])]
    prev, prev_known = torch.full((c, c), 9.0), torch.tensor([False, False, False])
    out, known = aggregate_class_logits(prev, prev_known, means, counts)
    # class 0: plain mean of the two clients (1 + 3) / 2; class 1 only client 0; class 2 only client 1
    assert torch.allclose(out, torch.tensor([[2.0, 0, 0], [0, 2.0, 0], [0, 0, 6.0]]))
    assert known.tolist() == [True, True, True]
    weighted, _ = aggregate_class_logits(prev, prev_known, means, counts, weighting="samples")
    assert weighted[0, 0].item() == pytest.approx((1 * 1 + 3 * 3) / 4)  # sample-weighted


def test_absent_classes_are_dropped_or_kept():
    prev = torch.tensor([[5.0, 5.0], [7.0, 7.0]])
    prev_known = torch.tensor([True, True])
    means, counts = [torch.tensor([[1.0, 0.0], [0.0, 0.0]])], [torch.tensor([2.0, 0.0])]
    dropped, known = aggregate_class_logits(prev, prev_known, means, counts, absent="drop")
    assert known.tolist() == [True, False] and dropped[0].tolist() == [1.0, 0.0]
    kept, known = aggregate_class_logits(prev, prev_known, means, counts, absent="keep")
    assert known.tolist() == [True, True] and kept[1].tolist() == [7.0, 7.0]


def test_client_uploads_the_mean_logits_it_produced_while_training(tmp_path):
    ctx, method = opened(tmp_path, {"name": "feddistill_plus", "form": "pfllib"},
                         train={"rounds": 1, "epochs": 1, "batch_size": 1000})
    data = ctx.data.client(0)
    ctx.layout.load(ctx.model, ctx.initial_weights)
    ctx.model.train()
    with torch.no_grad():  # one batch holds the whole client: its logits are those of the received model
        logits = ctx.model(data.x[data.indices])
    upload, _ = client_round(ctx, method, 0, 1, ctx.initial_weights)
    labels = data.labels()
    counts = torch.bincount(labels, minlength=10).float()
    assert torch.equal(upload["class_counts"], counts)
    expected = torch.zeros(10, 10).index_add_(0, labels, logits) / counts.clamp(min=1).unsqueeze(1)
    assert torch.allclose(upload["class_logits"], expected, atol=1e-5)


def test_round_one_is_plain_cross_entropy_and_later_rounds_add_the_term(tmp_path):
    ctx, method = opened(tmp_path, {"name": "feddistill_plus", "form": "pfllib", "lam": 0.5})
    data = ctx.data.client(1)
    x, y = data.x[:8], data.y[:8]
    from fedguide.methods import ClientContext

    first = ClientContext(1, 1, data, method.server_payload(1, 1, ctx.initial_weights), {})
    state = method.begin_local(ctx.model, first)
    with torch.no_grad():
        logits = ctx.model(x)
        got = method.local_loss(ctx.model, x, y, first, state).item()
        assert got == pytest.approx(F.cross_entropy(logits, y).item())
    method.class_logits = torch.randn(10, 10, generator=torch.Generator().manual_seed(0))
    method.known = torch.ones(10, dtype=torch.bool)
    later = ClientContext(1, 2, data, method.server_payload(2, 1, ctx.initial_weights), {})
    state = method.begin_local(ctx.model, later)
    with torch.no_grad():
        expected = F.cross_entropy(logits, y) + 0.5 * F.mse_loss(logits, method.class_logits[y])
        assert method.local_loss(ctx.model, x, y, later, state).item() == pytest.approx(expected.item(), rel=1e-6)


@pytest.mark.parametrize("name", ["feddistill_plus", "feduv"])
def test_composes_with_the_dw_regulariser_as_in_feddw_table_iv(tmp_path, name):
    cfg = tiny_config(method={"name": name}, regularizers=[{"name": "dw", "mu": 1.0}], train={"rounds": 2},
                      model={"head_bias": False})
    summary, rows, run_dir = run_tiny(tmp_path, cfg)
    assert summary["method"] == f"{name}+dw"
    assert summary["final_accuracy"] > 0.3
    from safetensors.torch import load_file

    state = load_file(run_dir / "checkpoints" / "last.safetensors")
    assert not torch.equal(state["method.dw.sl"], torch.eye(10))  # the DW term's soft labels were aggregated
    if name == "feddistill_plus":  # and the method's own targets beside them, moved off the identity
        assert state["method.prob_counts"].sum() > 0 and not torch.equal(state["method.targets"], torch.eye(10))


@pytest.mark.parametrize("form", ["released", "pfllib"])
def test_a_resumed_run_keeps_the_global_targets(tmp_path, form):
    from tests.tiny import Crash, crash_after, without_timing

    cfg = tiny_config(method={"name": "feddistill_plus", "form": form}, train={"rounds": 3})
    _, reference, _ = run_tiny(tmp_path, cfg, name="reference")
    with pytest.raises(Crash):
        run_tiny(tmp_path, cfg, name="crashed", log=crash_after(1))
    _, resumed, _ = run_tiny(tmp_path, cfg, name="crashed", resume=True)
    assert without_timing(resumed) == without_timing(reference)


# ---- the released form ----

def test_released_term_is_kldivloss_applied_to_probabilities_on_hand_computed_numbers():
    p = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.1, 0.8]])
    t = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.5, 0.5]])
    # Σ t·(log t − p) / B: row 0: 1·(0 − 0.7); row 1: 0.5·(log 0.5 − 0.1) + 0.5·(log 0.5 − 0.8); B = 2
    hand = ((0 - 0.7) + 0.5 * (math.log(0.5) - 0.1) + 0.5 * (math.log(0.5) - 0.8)) / 2
    assert released_term(p, t).item() == pytest.approx(hand)
    assert released_term(p, t).item() == pytest.approx(torch.nn.KLDivLoss(reduction="batchmean")(p, t).item())
    # the divergence it meant, and MSE over the B·C entries
    kl = (1 * (0 - math.log(0.7)) + 0.5 * (math.log(0.5) - math.log(0.1)) + 0.5 * (math.log(0.5) - math.log(0.8))) / 2
    assert released_term(p, t, "kl").item() == pytest.approx(kl)
    mse = ((0.3 ** 2 + 0.2 ** 2 + 0.1 ** 2) + (0.1 ** 2 + 0.4 ** 2 + 0.3 ** 2)) / 6
    assert released_term(p, t, "mse").item() == pytest.approx(mse)


def test_released_targets_blend_the_cumulative_average_with_the_previous_and_keep_identity_for_unseen():
    targets = torch.eye(3)
    sums = torch.tensor([[3.0, 1.0, 0.0], [0.5, 1.5, 0.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    counts = torch.tensor([4.0, 2.0, 0.0], dtype=torch.float64)
    out = aggregate_released(targets, sums, counts)
    # class 0: 0.5·(3, 1, 0)/4 + 0.5·(1, 0, 0); class 1: 0.5·(0.25, 0.75, 0) + 0.5·(0, 1, 0); class 2: identity
    expected = torch.tensor([[0.875, 0.125, 0.0], [0.125, 0.875, 0.0], [0.0, 0.0, 1.0]])
    assert torch.allclose(out, expected)
    again = aggregate_released(out, sums, counts, blend=1.0)  # blend 1: the cumulative average alone
    assert torch.allclose(again[0], torch.tensor([0.75, 0.25, 0.0]))


def test_released_client_uploads_probability_sums_of_its_trained_model_in_eval_mode(tmp_path):
    ctx, method = opened(tmp_path, {"name": "feddistill_plus"}, train={"rounds": 1, "epochs": 1, "batch_size": 16})
    upload, _ = client_round(ctx, method, 0, 1, ctx.initial_weights)
    data = ctx.data.client(0)
    trained = ctx.model
    ctx.layout.load(trained, upload["weights"])
    trained.eval()
    with torch.no_grad():
        probs = torch.softmax(trained(data.x[data.indices]), dim=1).double()
    labels = data.labels()
    assert torch.equal(upload["prob_counts"], torch.bincount(labels, minlength=10).double())
    assert torch.allclose(upload["prob_sums"], torch.zeros(10, 10, dtype=torch.float64).index_add_(0, labels, probs),
                          atol=1e-5)


def test_released_round_one_already_distils_to_one_hot_and_the_server_accumulates_every_round(tmp_path):
    ctx, method = opened(tmp_path, {"name": "feddistill_plus", "lam": 0.5})
    data = ctx.data.client(1)
    x, y = data.x[:8], data.y[:8]
    from fedguide.methods import ClientContext

    first = ClientContext(1, 1, data, method.server_payload(1, 1, ctx.initial_weights), {})
    assert torch.equal(first.payload["targets"], torch.eye(10))
    with torch.no_grad():
        logits = ctx.model(x)
        expected = F.cross_entropy(logits, y) + 0.5 * released_term(torch.softmax(logits, 1), torch.eye(10)[y])
        got = method.local_loss(ctx.model, x, y, first, method.begin_local(ctx.model, first))
    assert got.item() == pytest.approx(expected.item(), rel=1e-6)
    up = {"weights": ctx.initial_weights, "num_samples": 1}
    a = {**up, "prob_sums": torch.eye(10, dtype=torch.float64) * 2, "prob_counts": torch.full((10,), 2.0).double()}
    b = {**up, "prob_sums": torch.zeros(10, 10, dtype=torch.float64), "prob_counts": torch.zeros(10).double()}
    method.aggregate(1, ctx.initial_weights, [a])
    method.aggregate(2, ctx.initial_weights, [b])  # nothing new: the sums of round 1 still count
    assert torch.equal(method.prob_counts, torch.full((10,), 2.0).double())
    assert torch.allclose(method.targets, torch.eye(10))
