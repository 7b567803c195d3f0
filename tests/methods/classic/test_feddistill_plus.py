"""FedDistill+: the global per-class logits and the distillation term on hand-computed tensors, the client's
logit collection, and a run composed with FedDW's regulariser (FedDW Table IV)."""
import pytest
import torch
import torch.nn.functional as F

from fedguide.methods.classic.feddistill_plus import aggregate_class_logits, distill_term
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
    ctx, method = opened(tmp_path, {"name": "feddistill_plus"}, train={"rounds": 1, "epochs": 1, "batch_size": 1000})
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
    ctx, method = opened(tmp_path, {"name": "feddistill_plus", "lam": 0.5})
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
    if name == "feddistill_plus":
        assert state["method.class_known"].any()  # and the method's own per-class logits beside them


def test_a_resumed_run_keeps_the_global_logits(tmp_path):
    from tests.tiny import Crash, crash_after, without_timing

    cfg = tiny_config(method={"name": "feddistill_plus"}, train={"rounds": 3})
    _, reference, _ = run_tiny(tmp_path, cfg, name="reference")
    with pytest.raises(Crash):
        run_tiny(tmp_path, cfg, name="crashed", log=crash_after(1))
    _, resumed, _ = run_tiny(tmp_path, cfg, name="crashed", resume=True)
    assert without_timing(resumed) == without_timing(reference)
