"""FedEMA: the divergence-aware blend and its autoscaler, BYOL's loss and target EMA on hand-computed tensors,
and a client's two participations."""
import pytest
import torch

from fedguide.methods.personalised.fedema import byol_loss, divergence_aware_blend, ema_update_
from tests.methods.pfl_cases import client_round, opened

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py
SMALL = {"name": "fedema", "hidden_dim": 16, "projection_dim": 8, "flip": False, "probe_samples": 200}


def test_blend_with_a_fixed_scaler():
    local, glob = torch.tensor([3.0, 4.0, 1.0]), torch.tensor([0.0, 0.0, 5.0])
    measure = torch.tensor([True, True, False])  # distance over the first two entries: 5
    blend = torch.tensor([True, True, False])  # the third (a BN statistic, say) stays global
    out, mu, scaler = divergence_aware_blend(local, glob, blend, measure, scaler=0.1, tau=0.7)
    assert mu == pytest.approx(0.5) and scaler == 0.1
    assert torch.allclose(out, torch.tensor([1.5, 2.0, 5.0]))  # 0.5 * local + 0.5 * global
    out, mu, _ = divergence_aware_blend(local, glob, blend, measure, scaler=1.0, tau=0.7)
    assert mu == 1.0 and torch.allclose(out, torch.tensor([3.0, 4.0, 5.0]))  # μ = min(λ·d, 1): the local model


def test_autoscaler_makes_the_first_blend_tau():
    local, glob = torch.tensor([3.0, 4.0]), torch.zeros(2)
    every = torch.ones(2, dtype=torch.bool)
    out, mu, scaler = divergence_aware_blend(local, glob, every, every, scaler=None, tau=0.7)
    assert scaler == pytest.approx(0.7 / 5) and mu == pytest.approx(0.7)
    assert torch.allclose(out, torch.tensor([2.1, 2.8]))
    # later rounds keep that λ: twice the divergence gives μ = min(2·0.7, 1) = 1
    _, mu, _ = divergence_aware_blend(2 * local, glob, every, every, scaler=scaler, tau=0.7)
    assert mu == 1.0


def test_byol_loss_hand_computed_and_targets_take_no_gradient():
    q1 = torch.tensor([[1.0, 0.0]], requires_grad=True)
    q2 = torch.tensor([[1.0, 0.0]], requires_grad=True)
    t1 = torch.tensor([[2.0, 0.0]], requires_grad=True)  # same direction as q2: 2 - 2 = 0
    t2 = torch.tensor([[0.0, 3.0]], requires_grad=True)  # orthogonal to q1: 2 - 0 = 2
    loss = byol_loss(q1, q2, t1, t2)
    assert loss.item() == pytest.approx(2.0)
    loss.backward()
    assert t1.grad is None and t2.grad is None and q1.grad is not None


def test_target_ema_step():
    target, online = [torch.tensor([1.0, -2.0])], [torch.tensor([3.0, 2.0])]
    ema_update_(target, online, 0.75)
    assert torch.allclose(target[0], torch.tensor([1.5, -1.0]))  # 0.75·ξ + 0.25·θ


def test_first_participation_starts_global_and_the_second_blends_with_mu_tau(tmp_path):
    ctx, method = opened(tmp_path, SMALL)
    glob = ctx.initial_weights
    upload, res = client_round(ctx, method, 0, 1, glob)
    assert res.loss is not None and upload["ema_mu"] == 0.0
    assert set(upload) == {"weights", "heads", "num_samples", "ema_mu"}
    state = ctx.store.get(0, 1)
    assert set(state) >= {"online", "target"} and "scaler" not in state
    # round 2: a different global model; the client blends its own with it, μ = τ on the first blend
    new_global = glob + 0.01
    payload = method.server_payload(2, 0, new_global)
    from fedguide.methods import ClientContext

    cctx = ClientContext(0, 2, ctx.data.client(0), payload, dict(state))
    start, _, mu = method._blend(cctx)  # what fit starts from
    start = start[: ctx.layout.numel]
    assert mu == pytest.approx(0.7)
    assert cctx.state["scaler"] > 0
    mask = method.blend_mask[: ctx.layout.numel]
    local = state["online"][: ctx.layout.numel]
    expected = torch.where(mask, 0.7 * local + 0.3 * new_global, new_global)
    assert torch.allclose(start, expected, atol=1e-6)


@pytest.mark.parametrize("decay, follows", [(1.0, "received"), (0.0, "trained")])
def test_target_is_the_ema_of_the_online_network(tmp_path, decay, follows):
    ctx, method = opened(tmp_path, {**SMALL, "target_decay": decay})
    glob = ctx.initial_weights
    upload, _ = client_round(ctx, method, 0, 1, glob)
    target = ctx.store.get(0, 1)["target"]
    n = ctx.layout.numel
    encoder = ctx.layout.span("encoder.")
    params = ctx.layout.parameter_mask(ctx.model)[encoder]
    reference = glob if follows == "received" else upload["weights"]
    assert torch.allclose(target[:n][encoder][params], reference[encoder][params], atol=1e-6)
    assert not torch.equal(upload["weights"][encoder], glob[encoder])  # the online encoder did train


def test_evaluation_is_the_linear_probe_of_the_encoder(tmp_path):
    ctx, method = opened(tmp_path, SMALL)
    metrics = method.evaluate(1, ctx.initial_weights)
    assert metrics["accuracy"] == metrics["probe_accuracy"] and 0.3 < metrics["accuracy"] <= 1.0


def test_a_resumed_run_keeps_the_heads_targets_and_scalers(tmp_path):
    from tests.tiny import Crash, crash_after, run_tiny, tiny_config, without_timing

    cfg = tiny_config(method=SMALL, train={"rounds": 3}, clients={"num": 3, "per_round": 2})
    _, reference, _ = run_tiny(tmp_path, cfg, name="reference")
    with pytest.raises(Crash):
        run_tiny(tmp_path, cfg, name="crashed", log=crash_after(2))
    _, resumed, _ = run_tiny(tmp_path, cfg, name="crashed", resume=True)
    assert without_timing(resumed) == without_timing(reference)


def test_rounds_report_the_mean_blend(tmp_path):
    from tests.tiny import run_tiny, tiny_config

    cfg = tiny_config(method=SMALL, train={"rounds": 3}, clients={"num": 2, "per_round": 2})
    _, rows, _ = run_tiny(tmp_path, cfg)
    assert rows[0]["ema_mu"] == 0.0  # everyone's first participation starts from the global model
    assert rows[1]["ema_mu"] == pytest.approx(0.7)  # every client's first blend: μ = τ (autoscaler)
    assert 0.0 < rows[2]["ema_mu"] <= 1.0
