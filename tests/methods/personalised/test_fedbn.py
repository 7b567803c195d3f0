"""FedBN against its rule (Li et al., ICLR 2021; med-air/FedBN, federated/fed_digits.py, ``communication``,
lines 164-189: every entry but the BatchNorm layers averaged with weights 1/K, line 247; each client tested
with its own BatchNorm layers, lines 300-304)."""
from __future__ import annotations

import pytest
import torch

from fedguide.fl.setup import open_run, prepare
from fedguide.methods.personalised.fedbn import batch_norm_mask
from fedguide.registry import ConfigError
from tests.tiny import run_tiny, tiny_config


def tiny(rounds=2, model=None, **method):
    return tiny_config(model=model or {"name": "mlp", "hidden": 8, "feature_dim": 4, "batch_norm": True},
                       method={"name": "fedbn", **method}, clients={"num": 3, "per_round": 3},
                       train={"rounds": rounds}, eval={"mode": "both"}, seed=0)


def test_the_mask_covers_every_batchnorm_entry_and_nothing_else(tmp_path):
    ctx, _ = open_run(prepare(tiny()), tmp_path / "run")
    mask = batch_norm_mask(ctx.layout, ctx.model)
    # Two BatchNorm1d layers of widths 8 and 4: weight, bias, running mean and variance each, and the counter.
    assert int(mask.sum()) == 4 * 8 + 1 + 4 * 4 + 1
    norm_names = [n for n in ctx.layout.names if ".2." in n or ".5." in n]  # encoder.2 and encoder.5: the BNs
    assert len(norm_names) == 10
    offset = 0
    for name, shape in zip(ctx.layout.names, ctx.layout.shapes):
        n = int(torch.Size(shape).numel())
        assert bool(mask[offset: offset + n].all()) == (name in norm_names)
        assert bool(mask[offset: offset + n].any()) == (name in norm_names)
        offset += n


def _method(tmp_path, **params):
    ctx, method = open_run(prepare(tiny(**params)), tmp_path / "run")
    method.setup()
    return ctx, method


@pytest.mark.parametrize("weights, expected", [("equal", [2.0, 4.0]), ("samples", [2.5, 5.0])])
def test_the_shared_entries_are_averaged_and_the_servers_batchnorm_is_left_alone(tmp_path, weights, expected):
    # Two uploads of the shared entries, ones and threes (first entry) and twos and sixes (second):
    # equal weights (fed_digits.py line 247): (1 + 3)/2 = 2, (2 + 6)/2 = 4;
    # samples 1 and 3: (1 + 3*3)/4 = 2.5, (2 + 6*3)/4 = 5.
    ctx, method = _method(tmp_path, weights=weights)
    shared = method._shared.numel()
    a = torch.ones(shared)
    a[1::2] = 2.0
    b = 3 * a
    glob = ctx.initial_weights.clone()
    out = method.aggregate(1, glob, [{"shared": a, "num_samples": 1}, {"shared": b, "num_samples": 3}])
    assert out[method._shared][:2].tolist() == expected
    assert torch.equal(out[method._local], glob[method._local])


def test_each_client_keeps_its_own_batchnorm_layers_across_rounds(tmp_path):
    run_tiny(tmp_path, tiny(rounds=2))
    ctx, method = _method(tmp_path)
    ctx.store.recover(2)
    norms = [ctx.store.get(cid, 2)["norms"] for cid in range(3)]
    initial = ctx.initial_weights[method._local]
    assert all(not torch.equal(n, initial) for n in norms)  # trained: running statistics moved
    assert not torch.equal(norms[0], norms[1]) and not torch.equal(norms[1], norms[2])
    # A client's model is the global shared entries with its own BatchNorm layers.
    from fedguide.fl.checkpoint import load_checkpoint

    glob = load_checkpoint(tmp_path / "run" / "checkpoints").global_weights
    model = method.personal_model(2, 1, glob)
    assert torch.equal(model[method._local], norms[1])
    assert torch.equal(model[method._shared], glob[method._shared])
    assert torch.equal(glob[method._local], initial)  # the server never receives BatchNorm entries


def test_a_model_without_batchnorm_is_refused_with_the_key_to_set():
    with pytest.raises(ConfigError, match=r"method.name=fedbn needs model.batch_norm=true \(the config has false\); "
                                          "set model.batch_norm: true in the config, for every method compared"):
        prepare(tiny(model={"name": "mlp"}))
    prepare(tiny(model={"name": "resnet10"}))  # BatchNorm by construction: declared, accepted


def test_a_plugin_model_declaring_batchnorm_without_any_is_refused_when_opened(tmp_path, monkeypatch):
    from fedguide.methods.personalised import fedbn

    monkeypatch.setattr(fedbn, "batch_norm_mask", lambda layout, model: torch.zeros(layout.numel, dtype=torch.bool))
    with pytest.raises(ConfigError, match="model.name=mlp has none"):
        open_run(prepare(tiny()), tmp_path / "run")[1].setup()


def test_fedbn_resumes_to_the_uninterrupted_result(tmp_path):
    full = run_tiny(tmp_path, tiny(rounds=3), "full")[0]
    run_tiny(tmp_path, tiny(rounds=2), "cut")
    assert run_tiny(tmp_path, tiny(rounds=3), "cut", resume=True)[0]["accuracy_curve"] == full["accuracy_curve"]
