"""SCAFFOLD: option II control update, server update, gradient correction, FedAvg equivalence, e2e."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedguide.config import TrainConfig
from fedguide.fl.checkpoint import load_checkpoint
from fedguide.fl.setup import open_run, prepare
from fedguide.core.seeding import derive_seed, torch_generator
from fedguide.core.state import ClientStateStore
from fedguide.core.weights import WeightLayout
from fedguide.methods import ClientContext
from fedguide.methods.classic.scaffold import (Scaffold, ScaffoldParams, control_update, correction_term,
                                       momentum_factor, server_update)
from tests.tiny import run_tiny, tiny_config


# ---- option II -------------------------------------------------------------------------------------
def test_control_update_hand_computed():
    c_i, c = torch.tensor([0.5, -1.0]), torch.tensor([0.2, 0.3])
    x, y = torch.tensor([1.0, 2.0]), torch.tensor([0.8, 2.3])
    # (x - y) / (K·lr) = [0.2, -0.3] / (4·0.1) = [0.5, -0.75]; c_i - c = [0.3, -1.3]
    # c_i+ = [0.3 + 0.5, -1.3 - 0.75] = [0.8, -2.05]
    out = control_update(c_i, c, x, y, steps=4, lr=0.1)
    assert torch.allclose(out, torch.tensor([0.8, -2.05]))


def test_control_update_without_steps_keeps_the_control():
    c_i = torch.tensor([0.5, -1.0])
    out = control_update(c_i, torch.ones(2), torch.zeros(2), torch.zeros(2), steps=0, lr=0.1)
    assert torch.equal(out, c_i) and out is not c_i


def test_control_update_recovers_a_constant_gradient_under_plain_sgd():
    # K plain SGD steps on <w, g> move w by -K·lr·g, so option II gives c_i+ = g when c = c_i = 0.
    g = torch.tensor([0.3, -0.7, 1.1])
    w = torch.zeros(3, requires_grad=True)
    opt = torch.optim.SGD([w], lr=0.05)
    for _ in range(6):
        opt.zero_grad()
        (w * g).sum().backward()
        opt.step()
    out = control_update(torch.zeros(3), torch.zeros(3), torch.zeros(3), w.detach(), steps=6, lr=0.05)
    assert torch.allclose(out, g, atol=1e-6)


# ---- momentum factor --------------------------------------------------------------------------------
def test_momentum_factor_hand_computed():
    assert momentum_factor(7, 0.0) == 1.0  # the paper's plain SGD: no change
    assert momentum_factor(1, 0.9) == pytest.approx(1.0)  # first heavy-ball step = plain step
    # K = 2, β = 0.5: (1/2)·(1 + (1 + 0.5)) = 1.25
    assert momentum_factor(2, 0.5) == pytest.approx(1.25)
    assert momentum_factor(10_000, 0.9) == pytest.approx(10.0, rel=1e-3)  # → 1/(1 − β)
    assert momentum_factor(0, 0.9) == 1.0


def test_momentum_factor_makes_option_two_recover_the_gradient_under_momentum():
    g = torch.tensor([0.3, -0.7])
    w = torch.zeros(2, requires_grad=True)
    opt = torch.optim.SGD([w], lr=0.05, momentum=0.9)
    for _ in range(5):
        opt.zero_grad()
        (w * g).sum().backward()
        opt.step()
    lr = 0.05 * momentum_factor(5, 0.9)
    out = control_update(torch.zeros(2), torch.zeros(2), torch.zeros(2), w.detach(), steps=5, lr=lr)
    assert torch.allclose(out, g, atol=1e-6)
    literal = control_update(torch.zeros(2), torch.zeros(2), torch.zeros(2), w.detach(), steps=5, lr=0.05)
    assert (literal.abs() > 2.5 * g.abs()).all(), "without the factor, momentum inflates the estimate"


# ---- server update ----------------------------------------------------------------------------------
def _server_case():
    x = torch.tensor([1.0, 2.0, 3.0])  # two parameters, then one buffer
    mask = torch.tensor([True, True, False])
    c = torch.tensor([0.1, 0.2])
    dys = [torch.tensor([0.2, -0.4, 1.0]), torch.tensor([0.4, 0.0, -2.0])]
    dcs = [torch.tensor([1.0, 0.0]), torch.tensor([0.0, 2.0])]
    return x, c, dys, dcs, [1, 3], mask


def test_server_update_hand_computed_uniform():
    x, c, dys, dcs, n, mask = _server_case()
    x_new, c_new = server_update(x, c, dys, dcs, n, num_clients=4, param_mask=mask)
    # parameters: x + mean(Δy) = [1 + (0.2 + 0.4)/2, 2 + (-0.4 + 0)/2] = [1.3, 1.8]
    # buffer: sample-weighted mean of x + Δy_i = 3 + 0.25·1.0 + 0.75·(-2.0) = 1.75
    assert torch.allclose(x_new, torch.tensor([1.3, 1.8, 1.75]))
    # c + (|S|/N)·mean(Δc) = c + (1/4)·ΣΔc = [0.1 + 0.25, 0.2 + 0.5]
    assert torch.allclose(c_new, torch.tensor([0.35, 0.7]))


def test_server_update_sample_weighted_and_server_lr():
    x, c, dys, dcs, n, mask = _server_case()
    x_new, _ = server_update(x, c, dys, dcs, n, 4, mask, weighting="samples")
    # Δ = 0.25·[0.2, -0.4] + 0.75·[0.4, 0] = [0.35, -0.1]
    assert torch.allclose(x_new, torch.tensor([1.35, 1.9, 1.75]))
    x_half, c_half = server_update(x, c, dys, dcs, n, 4, mask, server_lr=0.5)
    # η_g = 0.5 scales the parameter step only: [1 + 0.15, 2 - 0.1]; buffers and c unchanged by η_g
    assert torch.allclose(x_half, torch.tensor([1.15, 1.9, 1.75]))
    assert torch.allclose(c_half, torch.tensor([0.35, 0.7]))


# ---- gradient correction ----------------------------------------------------------------------------
def test_correction_term_is_zero_valued_with_gradient_c_minus_ci():
    p = [torch.tensor([1.0, -2.0], requires_grad=True), torch.tensor([[3.0]], requires_grad=True)]
    d = [torch.tensor([0.5, 0.25]), torch.tensor([[-1.0]])]
    term = correction_term(p, d)
    assert term.item() == 0.0
    term.backward()
    assert torch.equal(p[0].grad, d[0]) and torch.equal(p[1].grad, d[1])


def _linear_method():
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    layout = WeightLayout.of(model)  # weight (6 values) then bias (2)
    run = SimpleNamespace(layout=layout, model=model, device=torch.device("cpu"))
    return model, Scaffold(ScaffoldParams(), run)


def test_local_loss_gradient_is_ce_gradient_minus_ci_plus_c():
    model, method = _linear_method()
    method.params = ScaffoldParams(correction="gradient")
    c = torch.arange(8, dtype=torch.float32) / 10
    c_i = torch.full((8,), 0.05)
    ctx = ClientContext(0, 2, None, {"control": c}, {"control": c_i})
    state = method.begin_local(model, ctx)
    x, y = torch.randn(4, 3), torch.tensor([0, 1, 1, 0])
    loss = method.local_loss(model, x, y, ctx, state)
    assert loss.item() == pytest.approx(F.cross_entropy(model(x), y).item())  # reported loss stays CE
    loss.backward()
    got = torch.cat([model.weight.grad.reshape(-1), model.bias.grad])
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    ce = torch.cat([model.weight.grad.reshape(-1), model.bias.grad])
    assert torch.allclose(got, ce + (c - c_i), atol=1e-7)


def test_step_correction_is_niid_benchs_plain_step_beside_the_momentum_step():
    """correction: step is NIID-Bench's train_net_scaffold: the optimiser (momentum 0.9) steps on the plain
    cross-entropy gradient and the weights then move by −η_l·(c − c_i); the control update divides by K·η_l
    with no momentum factor."""
    model, method = _linear_method()
    method.params = ScaffoldParams(correction="step", local_momentum=None)
    method.run.train = TrainConfig(lr=0.1, momentum=0.9, weight_decay=0.0)
    reference = nn.Linear(3, 2)
    reference.load_state_dict(model.state_dict())
    x0 = method.run.layout.flatten(model)
    c, c_i = torch.arange(8, dtype=torch.float32) / 10, torch.full((8,), 0.05)
    ctx = ClientContext(0, 2, Data(indices=torch.arange(12)), {"weights": x0, "control": c}, {"control": c_i})
    state = method.begin_local(model, ctx)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, reference))
    torch.manual_seed(0)
    for _ in range(3):
        x, y = torch.randn(4, 3), torch.tensor([0, 1, 1, 0])
        opt.zero_grad()
        loss = method.local_loss(model, x, y, ctx, state)
        assert loss.item() == pytest.approx(F.cross_entropy(model(x), y).item())
        loss.backward()
        method.after_backward(model, ctx, state)
        opt.step()
        ref_opt.zero_grad()
        F.cross_entropy(reference(x), y).backward()
        ref_opt.step()
        with torch.no_grad():  # net_para[key] - args.lr * (c_global_para[key] - c_local_para[key])
            reference.weight -= 0.1 * (c[:6] - c_i[:6]).view(2, 3)
            reference.bias -= 0.1 * (c[6:] - c_i[6:])
    got, want = method.run.layout.flatten(model), method.run.layout.flatten(reference)
    assert torch.allclose(got, want, atol=1e-6)
    ctx.steps = 3
    upload = method.client_upload(model, ctx, state)
    literal = c_i - c + (x0 - got) / (3 * 0.1)  # no momentum factor under correction: step
    assert torch.allclose(ctx.state["control"], literal, atol=1e-5)
    assert torch.allclose(upload["delta_c"], literal - c_i, atol=1e-5)


def test_no_correction_when_controls_are_equal():
    model, method = _linear_method()
    ctx = ClientContext(0, 1, None, {"control": torch.zeros(8)}, {})
    assert method.begin_local(model, ctx).pairs is None


def test_params_default_and_validation():
    p = ScaffoldParams()
    assert (p.server_lr, p.weighting, p.momentum_correction) == (1.0, "uniform", True)
    assert (p.local_momentum, p.control, p.correction) == (None, "option2", "step")
    with pytest.raises(ValueError):
        ScaffoldParams(server_lr=0.0)
    with pytest.raises(ValueError):
        ScaffoldParams(weighting="median")


def test_local_steps_use_the_runs_optimiser_unless_asked_otherwise():
    """A method's name does not change the train settings: SCAFFOLD takes the config's momentum."""
    train = TrainConfig(momentum=0.9, lr=0.05)
    assert Scaffold(ScaffoldParams(), None).local_train(train) is train
    plain = Scaffold(ScaffoldParams(local_momentum=0.0), None).local_train(train)
    assert (plain.momentum, plain.lr) == (0.0, 0.05) and train.momentum == 0.9
    assert Scaffold(ScaffoldParams(local_momentum=0.5), None).local_train(train).momentum == 0.5


class Data(SimpleNamespace):
    def __len__(self):
        return len(self.indices)


def test_option1_control_is_the_full_local_gradient_at_the_server_model():
    model, method = _linear_method()
    method.params = ScaffoldParams(control="option1")
    torch.manual_seed(1)
    n = 10
    data = Data(indices=torch.arange(n), x=torch.randn(n, 3), y=torch.arange(n) % 2)
    method.run.train = TrainConfig(batch_size=4, momentum=0.9)
    x0 = method.run.layout.flatten(model)
    ctx = ClientContext(0, 2, data, {"weights": x0, "control": torch.full((8,), 0.1)}, {})
    state = method.begin_local(model, ctx)
    F.cross_entropy(model(data.x), data.y).backward()  # the full-batch gradient, by hand
    full = torch.cat([model.weight.grad.reshape(-1), model.bias.grad])
    with torch.no_grad():
        model.weight.add_(1.0)  # local training moved the model: option I ignores where it went
    ctx.steps = 3
    upload = method.client_upload(model, ctx, state)
    assert torch.allclose(ctx.state["control"], full, atol=1e-6)
    assert torch.allclose(upload["delta_c"], full, atol=1e-6)  # c_i was 0


# ---- in-process runs on 8x8 digits ------------------------------------------------------------------
def config(**over):
    return tiny_config({"method": {"name": "scaffold"}}, **over)


def run(tmp_path, name="run", resume=False, **over):
    return run_tiny(tmp_path, config(**over), name, resume)


def _train_one_client(run_dir, method_name, **over):
    """Round 1, client 0, exactly as the engine runs it; returns the trained weights, upload, payload."""
    method = {"name": method_name} if isinstance(method_name, str) else method_name
    prepared = prepare(config(method=method, **over))
    ctx, method = open_run(prepared, run_dir)
    method.setup()
    cfg = prepared.config
    payload = method.server_payload(1, 0, ctx.initial_weights.clone())
    cctx = ClientContext(0, 1, ctx.data.client(0), payload, {}, generator=torch_generator(cfg.seed, "client", 1, 0))
    ctx.layout.load(ctx.model, method.client_start(cctx))
    torch.manual_seed(derive_seed(cfg.seed, "client", 1, 0))
    _, state = method.fit(ctx.model, cctx, cfg.train)
    return ctx.layout.flatten(ctx.model), method.client_upload(ctx.model, cctx, state), payload


def test_first_round_client_update_equals_fedavg(tmp_path):
    y_avg, _, _ = _train_one_client(tmp_path / "a", "fedavg")
    y_scaf, upload, payload = _train_one_client(tmp_path / "b", "scaffold")
    assert torch.equal(y_avg, y_scaf), "with c = c_i = 0 the local steps are FedAvg's, bit for bit"
    assert torch.allclose(payload["weights"] + upload["delta_y"], y_avg)
    assert set(upload) == {"delta_y", "delta_c", "num_samples"}
    y_plain, _, _ = _train_one_client(tmp_path / "c", {"name": "scaffold", "local_momentum": 0.0})
    y_avg_plain, _, _ = _train_one_client(tmp_path / "d", "fedavg", train={"momentum": 0.0})
    assert torch.equal(y_plain, y_avg_plain) and not torch.equal(y_plain, y_scaf), \
        "local_momentum: 0 is Algorithm 1's plain SGD"
    assert torch.any(upload["delta_c"] != 0)


def test_learns_and_keeps_controls(tmp_path):
    summary, rows, run_dir = run(tmp_path)  # the tiny config's optimiser: SGD lr 0.05, momentum 0.9
    assert summary["final_accuracy"] > 0.5
    store = ClientStateStore(run_dir / "client_state")
    seen = sorted({c for r in rows for c in r["clients"]})
    for cid in seen:
        state = store.get(cid)
        assert "control" in state and torch.isfinite(state["control"]).all()
        assert torch.any(state["control"] != 0)
    ckpt = load_checkpoint(run_dir / "checkpoints")
    c = ckpt.method_state["control"]
    assert torch.isfinite(c).all() and torch.any(c != 0)
    n_params = c.numel()
    n_weights = ckpt.global_weights.numel()
    # down: weights and the server control per client; up: Δy, Δc and num_samples
    assert rows[0]["bytes_down"] == 2 * 4 * (n_weights + n_params)
    assert rows[0]["bytes_up"] == 2 * (4 * (n_weights + n_params) + 8)
    assert n_params == n_weights  # the MLP has no buffers


def test_server_control_is_the_mean_of_client_controls_over_all_clients(tmp_path):
    # c ← c + (1/N)ΣΔc_i with c_i starting at 0 keeps c = (1/N)Σ_i c_i over all N clients.
    _, _, run_dir = run(tmp_path, clients={"num": 4, "per_round": 2})
    store = ClientStateStore(run_dir / "client_state")
    total = sum(store.get(cid).get("control", torch.zeros(1)) for cid in range(4))
    c = load_checkpoint(run_dir / "checkpoints").method_state["control"]
    assert torch.allclose(c, total / 4, atol=1e-5)


def test_resume_reproduces_an_uninterrupted_run(tmp_path):
    full, _, full_dir = run(tmp_path, "full", train={"rounds": 3})
    run(tmp_path, "cut", train={"rounds": 2})
    resumed, _, cut_dir = run(tmp_path, "cut", resume=True, train={"rounds": 3})
    assert resumed["accuracy_curve"] == full["accuracy_curve"]
    a = load_checkpoint(full_dir / "checkpoints")
    b = load_checkpoint(cut_dir / "checkpoints")
    assert torch.equal(a.global_weights, b.global_weights)
    assert torch.equal(a.method_state["control"], b.method_state["control"])


def test_a_run_written_before_the_correction_option_resumes_and_compares_as_it_ran(tmp_path):
    """A config.yaml from before ``correction`` existed ran the gradient form: read back (resume, sweeps) it
    keeps it, and the checkpoint's pinned settings, which lack the key too, still agree with it."""
    import yaml

    from fedguide.config import build_config, to_yaml
    from fedguide.fl.run_folder import RunFolder, compare_pinned, default_keys, pinned_config

    raw = yaml.safe_load(to_yaml(prepare(config()).config))
    assert raw["method"]["correction"] == "step"
    del raw["method"]["correction"]
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(raw))
    cfg = RunFolder(tmp_path).read_config()
    assert cfg.method.params_dict()["correction"] == "gradient"
    old_pin = pinned_config(build_config(raw))
    assert "correction" not in old_pin["method"]
    assert compare_pinned(old_pin, pinned_config(cfg), ("checkpoint", "config.yaml"), default_keys(cfg)).same
    # a request today (no key: the new default) is another run than that one
    today = prepare(config()).config
    assert not compare_pinned(pinned_config(cfg), pinned_config(today), ("run", "request"), default_keys(today)).same
