"""FedDW against its equations (the FedDW paper, Eq. 4-12, Theorem 1) and its composability."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fedguide.config import build_config
from fedguide.fl.engine import Experiment
from fedguide.core.training import local_objective, regularizer_terms
from fedguide.fl.setup import open_run, prepare
from fedguide.methods.base import ClientContext
from fedguide.methods.compose import Hooks
from fedguide.methods.classic.feddw import DWParams, aggregate_soft_labels, class_relation, dw_loss, mu_at, soft_label_matrix
from fedguide.models import MODELS, ModelSpec, build_model
from fedguide.registry import ConfigError


def test_eq11_on_a_hand_computed_three_class_example():
    # ω = [[1,0],[0,1],[0,0]] -> ωωᵀ = diag(1,1,0); softmax rows:
    #   rows 0,1: e/(e+2) = 0.576117, 1/(e+2) = 0.211942;  row 2: 1/3 each.
    # Ω = I: row 0 and 1 contribute (1-0.576117)² + 2·0.211942² = 0.269515 each,
    #        row 2 contributes (1/3)² + (1/3)² + (2/3)² = 0.666667.
    # L_reg = (2·0.269515 + 0.666667) / 3² = 0.133966
    omega = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]])
    e = math.e
    cr = class_relation(omega)
    assert cr[0].tolist() == pytest.approx([e / (e + 2), 1 / (e + 2), 1 / (e + 2)], abs=1e-6)
    assert cr[2].tolist() == pytest.approx([1 / 3] * 3, abs=1e-6)
    assert dw_loss(torch.eye(3), omega).item() == pytest.approx(0.133966, abs=1e-5)


@settings(max_examples=60, deadline=None, derandomize=True)
# scale ≤ 2 keeps ω ωᵀ near 64, so float64 softmax never saturates to an exact one-hot row (which
# would make L_reg exactly 0 against Ω = I although the real-valued bound is strict).
@given(c=st.integers(2, 12), k=st.integers(1, 16), scale=st.floats(0.01, 2.0), one_hot=st.booleans(),
       seed=st.integers(0, 10_000))
def test_theorem1_regulariser_is_bounded(c, k, scale, one_hot, seed):
    # 0 < L_reg < 2/C whenever Ω has probability rows (both sides' rows sum to one).
    g = torch.Generator().manual_seed(seed)
    omega = torch.randn(c, k, generator=g, dtype=torch.float64) * scale
    sl = torch.eye(c, dtype=torch.float64) if one_hot else torch.softmax(torch.randn(c, c, generator=g, dtype=torch.float64), 1)
    value = dw_loss(sl, omega).item()
    assert 0.0 < value < 2.0 / c


def test_soft_label_matrix_is_the_per_class_mean_of_softmax_outputs():
    probs = torch.tensor([[0.7, 0.2, 0.1], [0.5, 0.4, 0.1], [0.1, 0.8, 0.1]])
    labels = torch.tensor([0, 0, 1])
    sl, counts = soft_label_matrix(probs, labels, 3)
    assert counts.tolist() == [2, 1, 0]
    assert sl[0].tolist() == pytest.approx([0.6, 0.3, 0.1])
    assert sl[1].tolist() == pytest.approx([0.1, 0.8, 0.1])
    assert sl[2].tolist() == [0.0, 0.0, 0.0]  # absent class: no row (weighted by a zero count)


def test_eq7_aggregates_per_class_by_counts_and_keeps_unseen_rows():
    previous = torch.eye(3)
    a = torch.tensor([[0.8, 0.1, 0.1], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    b = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.6, 0.2], [0.0, 0.0, 0.0]])
    out = aggregate_soft_labels(previous, [a, b], [torch.tensor([2, 0, 0]), torch.tensor([1, 3, 0])])
    # row 0: (2·[0.8,0.1,0.1] + 1·[0.5,0.5,0]) / 3 = [0.7, 0.2333, 0.0667]
    assert out[0].tolist() == pytest.approx([0.7, 0.7 / 3, 0.2 / 3], abs=1e-6)
    assert out[1].tolist() == pytest.approx([0.2, 0.6, 0.2])  # only b holds class 1
    assert out[2].tolist() == [0.0, 0.0, 1.0]  # nobody holds class 2: previous row kept


def test_mu_decay_is_off_by_default_and_matches_the_released_schedule_when_on():
    assert [mu_at(DWParams(mu=1.0), r) for r in (1, 9, 10, 50)] == [1.0, 1.0, 1.0, 1.0]
    p = DWParams(mu=1.0, mu_decay_every=9)
    assert [mu_at(p, r) for r in (1, 9, 10, 19)] == pytest.approx([1.0, 1.0, 0.1, 0.01])


def test_the_head_really_has_no_bias():
    m = build_model("cnn", MODELS.get("cnn").params(mapping=[128, 128], head_bias=False), ModelSpec((1, 28, 28), 10))
    assert m.head.bias is None and m.head.weight.shape == (10, 128)
    assert not any(n.startswith("head.bias") for n in m.state_dict())


def tiny(method, **over):
    raw = {
        "data": {"name": "digits"},
        "partition": {"name": "dirichlet", "alpha": 0.5, "min_size": 5},
        "model": {"name": "mlp", "mapping": [32], "head_bias": False},
        "method": method,
        "clients": {"num": 4, "per_round": 4},
        "train": {"rounds": 3, "epochs": 2, "batch_size": 32, "lr": 0.05},
        "runtime": {"workers": 1, "threads_per_worker": 1},
        "seed": 2,
    }
    raw.update(over)
    return build_config(raw)


@pytest.mark.parametrize("model", [{"name": "mlp"}, {"name": "mlp", "head_bias": True}])
def test_feddw_refuses_a_head_with_a_bias_and_names_the_key_to_set(model):
    # Sec. III: ω has no bias. The method checks it and never sets it: the config's network is the network.
    with pytest.raises(ConfigError, match=r"method.name=feddw needs model.head_bias=false \(the config has true\); "
                                          r"set model.head_bias: false in the config, for every method compared"):
        prepare(tiny({"name": "feddw"}, model=model))
    with pytest.raises(ConfigError, match=r"regularizers: \[dw\] needs model.head_bias=false"):
        prepare(tiny({"name": "moon"}, model=model, regularizers=["dw"]))


def test_no_method_or_regulariser_changes_the_model_by_its_name():
    # Every registered method and regulariser, on a config that leaves the model to its defaults: the resolved
    # model is the config's, whatever the name (a requirement is refused, never applied).
    from fedguide.fl.setup import resolve
    from fedguide.methods import METHODS
    from fedguide.methods.compose import REGULARIZERS

    base = {"name": "mlp", "mapping": [32], "head_bias": False}
    expected = MODELS.parse_params("mlp", {k: v for k, v in base.items() if k != "name"}, "model").model_dump(mode="json")
    checked = 0
    for name in METHODS.names():
        try:
            resolved = resolve(tiny({"name": name}, model=dict(base)))
        except ConfigError:
            continue  # a method that needs another data set or model: not a name changing the model
        assert resolved.model.params.model_dump(mode="json") == expected, name
        checked += 1
    for name in REGULARIZERS.names():
        resolved = resolve(tiny({"name": "fedavg"}, model=dict(base), regularizers=[name]))
        assert resolved.model.params.model_dump(mode="json") == expected, name
    assert checked >= 20
    for obj in [METHODS.get(n).obj for n in METHODS.names()] + [REGULARIZERS.get(n).obj for n in REGULARIZERS.names()]:
        assert not hasattr(obj, "model_defaults"), obj


def test_feddw_keeps_the_configs_mapping_layers():
    assert prepare(tiny({"name": "feddw"})).config.model.params_dict()["mapping"] == [32]
    plain = prepare(tiny({"name": "feddw"}, model={"name": "mlp", "head_bias": False})).config.model.params_dict()
    assert plain["mapping"] == [] and plain["head_bias"] is False


def test_feddw_mnist_cnn_has_no_pooling_and_its_fc_layers_are_the_mapping_layers():
    params = MODELS.parse_params("cnn", {"pooling": False, "feature_dim": None, "channels": [10, 20],
                                         "mapping": [128, 128], "head_bias": False}, "model")
    m = build_model("cnn", params, ModelSpec((1, 28, 28), 10))
    assert not any(isinstance(x, torch.nn.MaxPool2d) for x in m.modules())
    linears = [x for x in m.modules() if isinstance(x, torch.nn.Linear)]
    # conv 5x5 twice without pooling: 28 -> 24 -> 20; 20 channels x 20 x 20 flattened into mapping layer 1
    assert [(x.in_features, x.out_features) for x in linears] == [(20 * 20 * 20, 128), (128, 128), (128, 10)]
    assert m(torch.zeros(2, 1, 28, 28)).shape == (2, 10)
    pooled = build_model("cnn", MODELS.parse_params("cnn", {}, "model"), ModelSpec((1, 28, 28), 10))
    assert sum(isinstance(x, torch.nn.MaxPool2d) for x in pooled.modules()) == 2  # the default keeps its pooling
    with pytest.raises(ValueError, match="at least 9x9"):
        build_model("cnn", params, ModelSpec((1, 8, 8), 10))


@pytest.mark.parametrize("setting", ["practical", "pathological"])
def test_feddw_mnist_paper_configs_use_the_unpooled_cnn(setting):
    from pathlib import Path

    from fedguide.config import load_config
    from fedguide.fl.setup import resolve

    resolved = resolve(load_config(Path(__file__).parents[3] / f"configs/paper/feddw_mnist_{setting}.yaml"))
    cfg, model = resolved.config, resolved.model.params
    assert cfg.model.name == "cnn" and not model.pooling and model.feature_dim is None
    assert model.mapping == [256, 128] and model.head_bias is False  # models.py CNN_mnist: fc1 256, fc2 128


def test_moon_plus_dw_loss_is_moon_loss_plus_mu_times_lreg(tmp_path):
    cfg = tiny({"name": "moon"}, regularizers=[{"name": "dw", "mu": 0.7}])
    ctx, method = open_run(prepare(cfg), tmp_path / "run")
    hooks = Hooks(method)
    hooks.setup()
    model = ctx.model
    g = torch.Generator().manual_seed(0)
    sl = torch.softmax(torch.randn(10, 10, generator=g), 1)
    method.regularizers[0].sl = sl  # a non-trivial global SL matrix
    prev = ctx.initial_weights + 0.01 * torch.randn(ctx.initial_weights.shape, generator=g)
    payload = hooks.server_payload(2, 0, ctx.initial_weights)
    assert torch.equal(payload["dw.sl"], sl)
    cctx = ClientContext(0, 2, ctx.data.client(0), payload, {"prev_weights": prev})
    ctx.layout.load(model, method.client_start(cctx))
    state = method.begin_local(model, cctx)
    assert state is not None  # MOON's contrastive term is active
    x, y = ctx.data.client(0).x[:16], ctx.data.client(0).y[:16]
    torch.manual_seed(0)
    total = local_objective(method, regularizer_terms(method, cctx), model, x, y, cctx, state)
    torch.manual_seed(0)
    moon_only = method.local_loss(model, x, y, cctx, state)
    assert total.item() == pytest.approx(moon_only.item() + 0.7 * dw_loss(sl, model.head.weight).item(), rel=1e-6)


def test_feddw_run_learns_uploads_sl_and_keeps_it_as_server_state(tmp_path):
    run_dir = tmp_path / "run"
    summary = Experiment(prepare(tiny({"name": "feddw", "mu": 1.0})), run_dir, log=lambda s: None).run()
    assert summary["final_accuracy"] > 0.5
    from safetensors.torch import load_file

    sl = load_file(run_dir / "checkpoints" / "last.safetensors")["method.dw.sl"]
    assert sl.shape == (10, 10)
    torch.testing.assert_close(sl.sum(1), torch.ones(10))  # every class seen: probability rows
    assert not torch.equal(sl, torch.eye(10))


def test_a_run_with_a_regulariser_resumes_to_the_uninterrupted_result(tmp_path):
    # MOON's previous models in the client store and DW's soft labels in the checkpoint (method.dw.sl) both
    # come back on resume.
    from fedguide.fl.checkpoint import load_checkpoint

    def run(name, rounds, resume=False):
        cfg = tiny({"name": "moon"}, regularizers=[{"name": "dw", "mu": 0.5}],
                   train={"rounds": rounds, "epochs": 1, "batch_size": 32, "lr": 0.05})
        return Experiment(prepare(cfg), tmp_path / name, log=lambda s: None).run(resume=resume)

    full = run("full", 3)
    run("cut", 2)
    resumed = run("cut", 3, resume=True)
    assert resumed["accuracy_curve"] == full["accuracy_curve"]
    a, b = (load_checkpoint(tmp_path / name / "checkpoints") for name in ("full", "cut"))
    assert set(a.method_state) == {"dw.sl"}
    assert torch.equal(a.method_state["dw.sl"], b.method_state["dw.sl"])
