"""FedBABU: only the body trains and travels; the head stays at its random initialisation; personalisation
fine-tunes the part asked for."""
import pytest
import torch
from safetensors.torch import load_file

from fedguide.methods._personalise import head_span
from tests.methods.pfl_cases import client_round, opened
from tests.tiny import run_tiny, tiny_config


def test_head_never_changes_during_federated_training(tmp_path):
    # Momentum and weight decay would move a head that merely got a zero gradient: the head takes none.
    cfg = tiny_config(method={"name": "fedbabu"}, train={"rounds": 3, "momentum": 0.9, "weight_decay": 0.01})
    _, _, run_dir = run_tiny(tmp_path, cfg)
    ctx, _ = opened(tmp_path / "fresh", {"name": "fedbabu"})
    ctx.layout.load(ctx.model, ctx.initial_weights)
    final = load_file(run_dir / "model.safetensors")
    initial = ctx.model.state_dict()
    assert torch.equal(final["head.weight"], initial["head.weight"])
    assert torch.equal(final["head.bias"], initial["head.bias"])
    assert not torch.equal(final["encoder.1.weight"], initial["encoder.1.weight"])  # the body did train


def test_the_head_neither_trains_nor_travels_on_a_client(tmp_path):
    ctx, method = opened(tmp_path, {"name": "fedbabu"})
    head = head_span(ctx.layout)
    payload = method.server_payload(1, 0, ctx.initial_weights)
    assert set(payload) == {"body"} and payload["body"].numel() == head.start
    upload, res = client_round(ctx, method, 0, 1, ctx.initial_weights)
    assert set(upload) == {"body", "num_samples"} and upload["body"].numel() == head.start
    trained = ctx.layout.flatten(ctx.model)
    assert res.loss is not None
    assert torch.equal(trained[head], ctx.initial_weights[head])
    assert not torch.equal(trained[: head.start], ctx.initial_weights[: head.start])


def test_aggregate_averages_the_bodies_by_samples_and_keeps_the_head(tmp_path):
    ctx, method = opened(tmp_path, {"name": "fedbabu"})
    head = head_span(ctx.layout)
    glob = ctx.initial_weights
    uploads = [{"body": torch.full((head.start,), 1.0), "num_samples": 1},
               {"body": torch.full((head.start,), 5.0), "num_samples": 3}]
    out = method.aggregate(1, glob, uploads)
    assert torch.allclose(out[: head.start], torch.full((head.start,), 4.0))  # (1·1 + 3·5) / 4
    assert torch.equal(out[head], glob[head])


@pytest.mark.parametrize("part, body_moves, head_moves", [("head", False, True), ("full", True, True),
                                                         ("body", True, False)])
def test_personalisation_fine_tunes_the_part_asked_for(tmp_path, part, body_moves, head_moves):
    ctx, method = opened(tmp_path, {"name": "fedbabu", "finetune_epochs": 1, "finetune_part": part})
    head = head_span(ctx.layout)
    glob = ctx.initial_weights.clone()
    personal = method.personal_model(1, 2, glob)
    assert (not torch.equal(personal[: head.start], glob[: head.start])) == body_moves
    assert (not torch.equal(personal[head], glob[head])) == head_moves
    assert torch.equal(method.personal_model(1, 2, glob), personal)  # seeded by (seed, round, client)
    assert all(p.requires_grad for p in ctx.model.parameters())  # nothing is left frozen


def test_head_fine_tuning_on_features_computed_once_equals_fine_tuning_through_the_frozen_body(tmp_path,
                                                                                              monkeypatch):
    import fedguide.methods._personalise as personalise
    ctx, method = opened(tmp_path, {"name": "fedbabu", "finetune_epochs": 3, "finetune_part": "head"})
    assert personalise.features_reusable(ctx.model, type("C", (), {"device_data": ctx.device_data})())
    passes = []
    hook = ctx.model.encoder.register_forward_hook(lambda *_: passes.append(1))
    glob = ctx.initial_weights.clone()
    fast = method.personal_model(2, 1, glob)
    fast_passes = len(passes)
    monkeypatch.setattr(personalise, "features_reusable", lambda *_: False)
    slow = method.personal_model(2, 1, glob)
    hook.remove()
    assert torch.allclose(fast, slow, atol=1e-6) and not torch.equal(fast, glob)
    assert fast_passes < len(passes) - fast_passes  # the body ran once over the data, not once per epoch


def test_features_are_not_reused_where_the_body_depends_on_the_batch_or_draws_noise(tmp_path):
    from torch import nn

    from fedguide.methods._personalise import features_reusable
    from fedguide.models.split import SplitModel
    plain = type("C", (), {"device_data": None})()
    assert features_reusable(SplitModel(nn.Sequential(nn.Linear(4, 3), nn.ReLU()), nn.Linear(3, 2), 3), plain)
    for layer in (nn.BatchNorm1d(3), nn.Dropout(0.1), nn.InstanceNorm1d(3, track_running_stats=True)):
        assert not features_reusable(SplitModel(nn.Sequential(nn.Linear(4, 3), layer), nn.Linear(3, 2), 3), plain)
    augmented = type("C", (), {"device_data": type("D", (), {"augment": lambda x: x})()})()
    assert not features_reusable(SplitModel(nn.Sequential(nn.Linear(4, 3)), nn.Linear(3, 2), 3), augmented)


def test_released_fine_tuning_is_sgd_with_momentum_on_body_and_head_at_1e_3(tmp_path):
    """jhoon-oh/FedBABU analysis.ipynb, cell 2: L87-91 one SGD over body and head params at args.lr (L22: 1e-3),
    momentum 0.9 (L4), no weight decay; L93-101 personalization_epoch (L6: 5) epochs. With one full batch an
    epoch: w1 = w0 − 1e-3·g0, w2 = w1 − 1e-3·(0.9·g0 + g1) (the momentum buffer starts at the first gradient)."""
    ctx, method = opened(tmp_path, {"name": "fedbabu", "finetune_epochs": 2},
                         train={"optimizer": "adam", "lr": 0.5, "weight_decay": 0.1, "batch_size": 10_000})
    p = method.params
    assert (p.finetune_part, p.finetune_lr, p.finetune_optimizer, p.finetune_momentum) == ("full", 0.001, "sgd", 0.9)
    glob = ctx.initial_weights.clone()
    personal = method.personal_model(1, 2, glob)
    data = ctx.data.client(2)

    def grad(weights):
        ctx.layout.load(ctx.model, weights)
        loss = torch.nn.functional.cross_entropy(ctx.model(data.x[data.indices]), data.y[data.indices])
        return torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, list(ctx.model.parameters()))])

    g0 = grad(glob)
    w1 = glob - 1e-3 * g0
    g1 = grad(w1)
    assert torch.allclose(personal, w1 - 1e-3 * (0.9 * g0 + g1), atol=1e-7)
    # head-only with the run's optimiser stays reachable (fedguide's earlier default)
    _, head_only = opened(tmp_path / "head", {"name": "fedbabu", "finetune_part": "head",
                                              "finetune_optimizer": "train", "finetune_lr": None})
    assert (head_only.params.finetune_part, head_only.params.finetune_optimizer) == ("head", "train")
