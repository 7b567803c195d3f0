"""FedRep: the head trains first with the representation fixed, then the representation with the head fixed;
only the representation travels and is averaged; the head lives in the client's state. The phases' one
optimiser on hand-computed Adam steps (lgcollins/FedRep models/Update.py; FedDW's Updata.py)."""
import pytest
import torch

import fedguide.methods._personalise as personalise
from fedguide.methods._personalise import head_span
from fedguide.methods.personalised.split_model.fedrep import FedRepParams
from fedguide.registry import ConfigError
from tests.methods.pfl_cases import client_round, opened


def test_head_epochs_then_body_epochs_each_with_the_other_part_frozen(tmp_path):
    ctx, method = opened(tmp_path, {"name": "fedrep", "head_epochs": 2, "body_epochs": 1})
    phases = []  # at every step's pass through the head: which parts train

    def recording(model, _):
        if model.training:
            phases.append(("head" if ctx.model.head.weight.requires_grad else "") +
                          ("body" if next(ctx.model.encoder.parameters()).requires_grad else ""))

    ctx.model.head.register_forward_pre_hook(recording)
    _, res = client_round(ctx, method, 0, 1, ctx.initial_weights)
    batches = -(-len(ctx.data.client(0)) // ctx.config.train.batch_size)  # ceil: one epoch's steps
    assert phases == ["head"] * (2 * batches) + ["body"] * batches
    assert res.loss is not None


def test_the_head_phase_on_features_computed_once_equals_the_phase_through_the_fixed_representation(
        tmp_path, monkeypatch):
    passes = []

    def one_round(name):
        ctx, method = opened(tmp_path / name, {"name": "fedrep", "head_epochs": 3, "body_epochs": 1})
        hook = ctx.model.encoder.register_forward_hook(lambda *_: passes.append(name))
        upload, res = client_round(ctx, method, 0, 1, ctx.initial_weights)
        hook.remove()
        return upload["shared"], ctx.store.get(0, 1)["personal"], res.loss

    fast = one_round("fast")
    monkeypatch.setattr(personalise, "features_reusable", lambda *_: False)
    slow = one_round("slow")
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(fast[:2], slow[:2]))
    assert abs(fast[2] - slow[2]) < 1e-5
    assert passes.count("fast") < passes.count("slow") / 2  # 3 head epochs cost one pass of the body


def test_the_head_never_leaves_the_client(tmp_path):
    ctx, method = opened(tmp_path, {"name": "fedrep", "head_epochs": 1})
    head = head_span(ctx.layout)
    payload = method.server_payload(1, 0, ctx.initial_weights)
    assert set(payload) == {"shared"} and payload["shared"].numel() == head.start
    upload, _ = client_round(ctx, method, 0, 1, ctx.initial_weights)
    assert set(upload) == {"shared", "num_samples"} and upload["shared"].numel() == head.start
    trained = ctx.layout.flatten(ctx.model)
    state = ctx.store.get(0, 1)
    assert torch.equal(state["personal"], trained[head])  # the trained head, kept by the client
    assert not torch.equal(trained[head], ctx.initial_weights[head])

    # Next round the client starts from the new global representation and its own head.
    new_global = ctx.initial_weights.clone()
    new_global[: head.start] += 0.5
    start = method.client_start(type("Ctx", (), {"payload": method.server_payload(2, 0, new_global),
                                                 "state": state})())
    assert torch.equal(start[: head.start], new_global[: head.start]) and torch.equal(start[head], trained[head])


def test_server_averages_representations_and_personal_models_use_each_clients_head(tmp_path):
    ctx, method = opened(tmp_path, {"name": "fedrep", "head_epochs": 1})
    head = head_span(ctx.layout)
    uploads = [client_round(ctx, method, cid, 1, ctx.initial_weights)[0] for cid in (0, 1)]
    n0, n1 = (u["num_samples"] for u in uploads)
    glob = method.aggregate(1, ctx.initial_weights, uploads)
    expected = (n0 * uploads[0]["shared"].double() + n1 * uploads[1]["shared"].double()) / (n0 + n1)
    assert torch.allclose(glob[: head.start].double(), expected, atol=1e-6)
    assert torch.equal(glob[head], ctx.initial_weights[head])  # the server has no head of its own
    for cid in (0, 1):
        personal = method.personal_model(1, cid, glob)
        assert torch.equal(personal[: head.start], glob[: head.start])
        assert torch.equal(personal[head], ctx.store.get(cid, 1)["personal"])
    # A client that has not trained yet holds the initial head.
    assert torch.equal(method.personal_model(1, 3, glob)[head], ctx.initial_weights[head])
    assert set(method.evaluate(1, glob)) >= {"accuracy", "client_accuracy_min", "client_accuracy_max"}


# ---- the phases' optimiser (lgcollins/FedRep models/Update.py L559-565 and L598-642; FedDW Updata.py L475-534) --
ADAM = {"optimizer": "adam", "lr": 0.01, "weight_decay": 0.0, "batch_size": 10_000}  # one step per epoch


def _one_step_phases(tmp_path, optimizer, client_state=None):
    """A client round of 1 head epoch and 1 representation epoch, each one full-batch Adam step; returns
    (start weights, trained weights, the head's gradient at the start, the body's after the head step)."""
    ctx, method = opened(tmp_path, {"name": "fedrep", "head_epochs": 1, "body_epochs": 1, "optimizer": optimizer},
                         train=ADAM)
    head = head_span(ctx.layout)
    start = ctx.initial_weights.clone()
    if client_state is not None:
        ctx.store.put(0, 1, client_state(start[head]))
        ctx.store.commit(1)
    client_round(ctx, method, 0, 2, start)
    trained = ctx.layout.flatten(ctx.model)
    data = ctx.data.client(0)

    def grad_at(weights, part):
        ctx.layout.load(ctx.model, weights)
        loss = torch.nn.functional.cross_entropy(ctx.model(data.x[data.indices]), data.y[data.indices])
        params = list(getattr(ctx.model, part).parameters())
        return torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params)])

    g_head = grad_at(start, "head")
    after_head = start.clone()
    after_head[head] -= 0.01 * g_head / (g_head.abs() + 1e-8)  # Adam's first step: lr · g / (|g| + eps)
    g_body = grad_at(after_head, "encoder")
    return ctx, start, trained, g_head, g_body


def test_one_optimiser_keeps_moving_the_head_by_its_moments_in_the_representation_epochs(tmp_path):
    """Update.py L559 builds one optimiser before the epoch loop and L638 zeroes gradients with torch 0.4.1's
    ``zero_grad`` (a zeroed gradient stays): in the representation epoch the head takes Adam's second step with a
    zero gradient. By hand (β1 0.9, β2 0.999): m = 0.9·0.1·g, v = 0.999·0.001·g², bias corrections 1 − 0.9² and
    1 − 0.999², so the head moves a further lr · (0.09 g / 0.19) / (√(0.000999 g² / 0.001999) + eps), 0.670 lr
    per element; the body, without a gradient in the head epoch, takes a first step lr · g / (|g| + eps)."""
    ctx, start, trained, g_head, g_body = _one_step_phases(tmp_path, "shared")
    head = head_span(ctx.layout)
    first = 0.01 * g_head / (g_head.abs() + 1e-8)
    second = 0.01 * (0.09 * g_head / 0.19) / ((0.000999 * g_head ** 2 / (1 - 0.999 ** 2)).sqrt() + 1e-8)
    assert torch.allclose(trained[head], start[head] - first - second, atol=1e-6)
    assert float((second.abs() / 0.01)[g_head.abs() > 1e-4].mean()) == pytest.approx(0.670046, abs=1e-4)
    body_step = 0.01 * g_body / (g_body.abs() + 1e-8)
    assert torch.allclose(trained[: head.start], start[: head.start] - body_step, atol=1e-6)


def test_a_fresh_optimiser_per_phase_leaves_the_frozen_head_where_its_epochs_left_it(tmp_path):
    ctx, start, trained, g_head, g_body = _one_step_phases(tmp_path, "per_phase")
    head = head_span(ctx.layout)
    assert torch.allclose(trained[head], start[head] - 0.01 * g_head / (g_head.abs() + 1e-8), atol=1e-6)
    assert torch.allclose(trained[: head.start], start[: head.start] - 0.01 * g_body / (g_body.abs() + 1e-8),
                          atol=1e-6)


def test_kept_gradients_count_the_head_epochs_in_the_representations_adam_steps(tmp_path):
    """FedDW keeps ``client.model`` across rounds (main.py L334-335) with the gradients torch 1.12's
    ``model.zero_grad()`` (Updata.py L494) zeroes but keeps: from a client's second round its representation is
    stepped with zero gradients in the head epoch (Adam step 1: m = v = 0, no move) and takes its first real step
    as Adam's second: lr · (0.1 g / 0.19) / (√(0.001 g² / 0.001999) + eps), 0.744 lr per element."""
    ctx, start, trained, g_head, g_body = _one_step_phases(
        tmp_path, "shared_kept_grads", client_state=lambda own_head: {"personal": own_head})
    head = head_span(ctx.layout)
    step = 0.01 * (0.1 * g_body / 0.19) / ((0.001 * g_body ** 2 / (1 - 0.999 ** 2)).sqrt() + 1e-8)
    assert torch.allclose(trained[: head.start], start[: head.start] - step, atol=1e-6)
    assert float((step.abs() / 0.01)[g_body.abs() > 1e-4].mean()) == pytest.approx(0.744135, abs=1e-4)
    # In a client's first round there is nothing kept: the representation's first step is Adam's first.
    ctx, start, trained, _, g_body = _one_step_phases(tmp_path / "first", "shared_kept_grads")
    assert torch.allclose(trained[: head.start], start[: head.start] - 0.01 * g_body / (g_body.abs() + 1e-8),
                          atol=1e-6)


def test_rest_gives_the_representation_the_epochs_the_head_leaves(tmp_path):
    """FedDW's Updata.py L489 and L519: ``range(head_ep)`` head epochs, then ``range(head_ep, client_epoch)``."""
    ctx, method = opened(tmp_path, {"name": "fedrep", "head_epochs": 1, "body_epochs": "rest"},
                         train={"epochs": 3})
    phases = []
    ctx.model.head.register_forward_pre_hook(
        lambda m, _: phases.append("head" if ctx.model.head.weight.requires_grad else "body") if m.training else None)
    client_round(ctx, method, 0, 1, ctx.initial_weights)
    batches = -(-len(ctx.data.client(0)) // ctx.config.train.batch_size)
    assert phases == ["head"] * batches + ["body"] * 2 * batches
    with pytest.raises(ConfigError, match="raise train.epochs above 3"):
        opened(tmp_path / "short", {"name": "fedrep", "head_epochs": 3, "body_epochs": "rest"}, train={"epochs": 3})
    with pytest.raises(ConfigError, match="unset train.local_steps"):
        opened(tmp_path / "steps", {"name": "fedrep", "body_epochs": "rest"}, train={"local_steps": 5})


def test_the_official_scripts_head_epochs_and_feddws_preset():
    """scripts/FedRep_*.sh: local_ep − local_rep_ep = 11 − 1 or 15 − 5 = 10 head epochs; FedDW's config.py
    head_ep = 1, Updata.py L456-537."""
    assert FedRepParams().head_epochs == 10 and FedRepParams().optimizer == "shared"
    feddw = FedRepParams(protocol="feddw")
    assert (feddw.head_epochs, feddw.body_epochs, feddw.optimizer, feddw.last_local_eval) == \
        (1, "rest", "shared_kept_grads", True)
    assert FedRepParams(protocol="feddw", head_epochs=2).head_epochs == 2  # an explicit option wins
