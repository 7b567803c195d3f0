"""FedRep: the head trains first with the representation fixed, then the representation with the head fixed;
only the representation travels and is averaged; the head lives in the client's state."""
import torch

import fedguide.methods._personalise as personalise
from fedguide.methods._personalise import head_span
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
