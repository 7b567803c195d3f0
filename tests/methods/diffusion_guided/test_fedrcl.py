"""FedRCL's relaxed supervised contrastive loss on hand-computed cases, and its level-wise hooks."""
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from fedguide.core.weights import WeightLayout
from fedguide.methods import METHODS, ClientContext
from fedguide.methods.diffusion_guided.fedrcl import (FedRCL, FedRCLParams, divergence_penalty_per_anchor, relaxed_supcon_loss,
                                     select_levels, supcon_per_anchor)
from fedguide.models import MODELS, ModelSpec, build_model
from fedguide.models.taps import FeatureTap, encoder_stages, level_representation
from fedguide.registry import ConfigError


def t(rows):
    return torch.tensor(rows, dtype=torch.float32)


def labels(*ys):
    return torch.tensor(ys)


# ---- SupCon -----------------------------------------------------------------------------------------

def test_supcon_hand_computed_three_samples():
    # z1 = (1,0), z2 = (0,1) in class 0; z3 = (-1,0) in class 1; tau = 1.
    # s12 = 0, s13 = -1, s23 = 0.
    # anchor 1: -log(e^0 / (e^0 + e^-1)) = log(1 + e^-1); anchor 2: -log(e^0 / (e^0 + e^0)) = log 2;
    # anchor 3 has no positive: left out.
    f, y = t([[1, 0], [0, 1], [-1, 0]]), labels(0, 0, 1)
    expected = (math.log(1 + math.exp(-1)) + math.log(2)) / 2
    assert relaxed_supcon_loss(f, y, tau=1.0, beta=0.0).item() == pytest.approx(expected, rel=1e-6)
    assert expected == pytest.approx(0.503204, abs=1e-6)
    per_anchor, has_pos = supcon_per_anchor(f, y, 1.0)
    assert has_pos.tolist() == [True, True, False]
    assert per_anchor[:2].tolist() == pytest.approx([math.log(1 + math.exp(-1)), math.log(2)], rel=1e-6)


def test_supcon_two_positives_averages_their_log_probabilities():
    # Anchor 1 with positives 2 and 3 and negative 4, tau = 0.5:
    # s12 = 0.6, s13 = 0, s14 = -1 → -(1/2)[log p12 + log p13], p1j = e^(s1j/τ) / Σ_a e^(s1a/τ).
    f = t([[1, 0], [0.6, 0.8], [0, 1], [-1, 0]])
    y = labels(0, 0, 0, 1)
    tau = 0.5
    den = math.exp(0.6 / tau) + math.exp(0) + math.exp(-1 / tau)
    anchor1 = -0.5 * ((0.6 / tau - math.log(den)) + (0 - math.log(den)))
    per_anchor, _ = supcon_per_anchor(f, y, tau)
    assert per_anchor[0].item() == pytest.approx(anchor1, rel=1e-6)


def test_cosine_similarity_ignores_the_scale_of_features():
    f, y = t([[1, 0], [0, 1], [-1, 0]]), labels(0, 0, 1)
    scaled = f * t([[3], [0.5], [7]])
    assert relaxed_supcon_loss(scaled, y, 1.0, 1.0, 0.5).item() == pytest.approx(
        relaxed_supcon_loss(f, y, 1.0, 1.0, 0.5).item(), rel=1e-6)


# ---- the divergence penalty ---------------------------------------------------------------------------

def test_penalty_hand_computed_two_samples():
    # One pair of the same class with s = 0.6, tau = 0.5. SupCon is 0 (the only other sample is the
    # positive). Over the threshold 0.5 the penalty is -log(e^(1/τ) / (e^(1/τ) + e^(0.6/τ))) = log(1 + e^-0.8).
    f, y = t([[1, 0], [0.6, 0.8]]), labels(0, 0)
    penalty = math.log(1 + math.exp(-0.8))
    assert penalty == pytest.approx(0.371101, abs=1e-6)
    assert relaxed_supcon_loss(f, y, tau=0.5, beta=0.0, lam=0.5).item() == pytest.approx(0.0, abs=1e-7)
    assert relaxed_supcon_loss(f, y, tau=0.5, beta=1.0, lam=0.5).item() == pytest.approx(penalty, rel=1e-6)
    assert relaxed_supcon_loss(f, y, tau=0.5, beta=2.0, lam=0.5).item() == pytest.approx(2 * penalty, rel=1e-6)
    # Under the threshold (0.6 < 0.7) nothing is penalised.
    assert relaxed_supcon_loss(f, y, tau=0.5, beta=1.0, lam=0.7).item() == pytest.approx(0.0, abs=1e-7)


def test_penalty_sums_every_over_similar_positive_in_one_log():
    # Anchor 1 with s12 = 0.8, s13 = 0.6 (same class), tau = 1, lam = 0.5: log(1 + e^-0.2 + e^-0.4).
    f = t([[1, 0], [0.8, 0.6], [0.6, 0.8]])
    y = labels(0, 0, 0)
    dp = divergence_penalty_per_anchor(f, y, tau=1.0, lam=0.5)
    assert dp[0].item() == pytest.approx(math.log(1 + math.exp(-0.2) + math.exp(-0.4)), rel=1e-6)
    # With lam = 0.7 only the pair at 0.8 counts for anchor 1; s23 = 0.96 counts for anchors 2 and 3.
    dp = divergence_penalty_per_anchor(f, y, tau=1.0, lam=0.7)
    assert dp.tolist() == pytest.approx([math.log(1 + math.exp(-0.2)),
                                         math.log(1 + math.exp(-0.2) + math.exp(-0.04)),
                                         math.log(1 + math.exp(-0.04))], rel=1e-5)


def test_penalty_ignores_other_classes_however_similar():
    f, y = t([[1, 0], [1, 0]]), labels(0, 1)  # identical features, different classes
    assert divergence_penalty_per_anchor(f, y, tau=0.1, lam=0.0).tolist() == [0.0, 0.0]


def test_penalty_pushes_over_similar_positives_apart_and_leaves_the_rest():
    f = torch.tensor([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0], [0.1, 0.9]], requires_grad=True)
    y = labels(0, 0, 1, 0)  # 1-2 are over the threshold; 1-4 and 2-4 are under it
    divergence_penalty_per_anchor(f, y, tau=0.5, lam=0.9).mean().backward()
    with torch.no_grad():
        stepped = F.normalize(f - 0.1 * f.grad, dim=1)
        before = F.normalize(f, dim=1)
        assert stepped[0] @ stepped[1] < before[0] @ before[1]
    assert torch.count_nonzero(f.grad[2]) == 0 and torch.count_nonzero(f.grad[3]) == 0


def test_threshold_one_switches_the_penalty_off():
    torch.manual_seed(0)
    f, y = torch.randn(12, 5), torch.randint(0, 3, (12,))
    assert relaxed_supcon_loss(f, y, 0.05, 5.0, lam=1.0).item() == pytest.approx(
        relaxed_supcon_loss(f, y, 0.05, 0.0).item(), rel=1e-6)


# ---- against a plain loop --------------------------------------------------------------------------

def loop_reference(f, y, tau, beta, lam):
    z = F.normalize(f, dim=1)
    n = len(y)
    terms = []
    for i in range(n):
        pos = [p for p in range(n) if p != i and y[p] == y[i]]
        if not pos:
            continue
        den = sum(math.exp(float(z[i] @ z[a]) / tau) for a in range(n) if a != i)
        scl = -sum(float(z[i] @ z[p]) / tau - math.log(den) for p in pos) / len(pos)
        over = [p for p in pos if float(z[i] @ z[p]) > lam]
        dp = -math.log(math.exp(1 / tau) / (math.exp(1 / tau) + sum(math.exp(float(z[i] @ z[p]) / tau) for p in over)))
        terms.append(scl + beta * dp)
    return sum(terms) / len(terms) if terms else 0.0


@pytest.mark.parametrize("seed", range(4))
def test_matches_a_loop_over_anchors(seed):
    g = torch.Generator().manual_seed(seed)
    f = torch.randn(10, 4, generator=g) + torch.tensor([1.0, 0, 0, 0])  # some pairs over the threshold
    y = torch.randint(0, 3, (10,), generator=g)
    for tau, beta, lam in [(0.5, 1.0, 0.6), (0.2, 2.0, 0.3), (1.0, 0.5, -0.5)]:
        got = relaxed_supcon_loss(f.double(), y, tau, beta, lam).item()
        assert got == pytest.approx(loop_reference(f.double(), y, tau, beta, lam), rel=1e-9)


# ---- batches without positives ------------------------------------------------------------------------

@pytest.mark.parametrize("y", [labels(0, 1, 2, 3), labels(4)])
def test_no_positive_pair_gives_zero_with_a_finite_gradient(y):
    f = torch.randn(len(y), 3, requires_grad=True)
    value = relaxed_supcon_loss(f, y, 0.05, 1.0, 0.0)
    assert value.item() == 0.0
    value.backward()
    assert torch.isfinite(f.grad).all() and torch.count_nonzero(f.grad) == 0


def test_singleton_class_is_no_anchor_but_still_a_negative():
    f = t([[1, 0], [0, 1], [-1, 0]])
    y = labels(0, 0, 1)
    full, _ = supcon_per_anchor(f, y, 1.0)
    # Without sample 3, anchors 1 and 2 would only see each other: loss 0. With it, they are not 0.
    assert full[0].item() > 0 and full[1].item() > 0
    assert relaxed_supcon_loss(f[:2], y[:2], 1.0, 0.0).item() == pytest.approx(0.0, abs=1e-7)
    f.requires_grad_(True)
    relaxed_supcon_loss(f, y, 1.0, 1.0, 0.5).backward()
    assert torch.isfinite(f.grad).all()


def test_small_temperature_is_finite():
    torch.manual_seed(2)
    f = torch.randn(16, 8, requires_grad=True)
    y = torch.randint(0, 2, (16,))
    value = relaxed_supcon_loss(f, y, tau=0.001, beta=1.0, lam=-1.0)
    value.backward()
    assert math.isfinite(value.item()) and torch.isfinite(f.grad).all()


# ---- parameters -------------------------------------------------------------------------------------

def test_params_defaults_and_validation():
    p = FedRCLParams()
    assert (p.lam, p.beta, p.tau, p.weight, p.levels, p.preactivation) == (0.6, 1.0, 0.05, 1.0, None, True)
    assert METHODS.get("fedrcl").params is FedRCLParams
    assert (p.lambda_role, p.threshold, p.sd_image_size) == ("threshold", 0.7, "paper")
    for bad in ({"lam": 1.5}, {"beta": -1}, {"tau": 0}, {"weight": -0.1}, {"levels": []}, {"unknown": 1},
                {"lambda_role": "both"}):
        with pytest.raises(ValueError):
            FedRCLParams(**bad)


def test_lambda_role_says_which_setting_lambda_is_on_hand_computed_numbers():
    """FedDifRC's λ = 0.6 read as FedRCL's similarity threshold (the default) or as the RCL loss weight, the other
    setting then as FedRCL's released config has it (skynbe/FedRCL/configs/client/fedrcl.yaml: the penalty's
    ``threshold: 0.7`` L27, the loss weights ``weight: 1`` L19, L24, L28).

    z_a = (1, 0), z_b = (0.65, √(1 − 0.65²)) in class 0, z_c = (0, 1) in class 1; τ = 0.5, β = 1:
    s_ab = 0.65, s_ac = 0, s_bc = 0.759934.
    L_SCL(a) = log(1 + e^((s_ac − s_ab)/τ)) = log(1 + e^−1.3) = 0.241008
    L_SCL(b) = log(1 + e^((s_bc − s_ab)/τ)) = log(1 + e^0.219868) = 0.809112
    L_DP(a) = L_DP(b) = log(1 + e^((s_ab − 1)/τ)) = log(1 + e^−0.7) = 0.403186 where 0.65 is over the threshold.
    threshold (λ = 0.6 < 0.65): weight 1 · ((0.241008 + 0.809112)/2 + 0.403186) = 0.928246
    weight (threshold 0.7 > 0.65, no penalty): λ · (0.241008 + 0.809112)/2 = 0.6 · 0.525060 = 0.315036"""
    c = 0.65
    f, y = t([[1, 0], [c, math.sqrt(1 - c * c)], [0, 1]]), labels(0, 0, 1)

    def term(p):
        return p.rcl_weight() * relaxed_supcon_loss(f, y, tau=0.5, beta=1.0, lam=p.rcl_threshold()).item()

    as_threshold, as_weight = FedRCLParams(lam=0.6), FedRCLParams(lam=0.6, lambda_role="weight")
    assert (as_threshold.rcl_threshold(), as_threshold.rcl_weight()) == (0.6, 1.0)
    assert (as_weight.rcl_threshold(), as_weight.rcl_weight()) == (0.7, 0.6)
    assert term(as_threshold) == pytest.approx(0.928246, abs=2e-6)
    assert term(as_weight) == pytest.approx(0.315036, abs=2e-6)
    assert term(FedRCLParams(lam=0.6, lambda_role="weight", threshold=0.6)) == pytest.approx(0.6 * 0.928246, abs=2e-6)


def test_a_setting_the_chosen_reading_hands_to_lambda_is_refused_not_ignored():
    with pytest.raises(ValueError, match="threshold 0.5 applies with lambda_role: weight"):
        FedRCLParams(threshold=0.5)
    with pytest.raises(ValueError, match="weight 2.0 applies with lambda_role: threshold"):
        FedRCLParams(lambda_role="weight", weight=2.0)
    with pytest.raises(ValueError, match="loss weight"):
        FedRCLParams(lambda_role="weight", lam=-0.2)
    # a run folder's config.yaml writes every option out: the defaults of the other reading read back fine
    FedRCLParams(**FedRCLParams(lambda_role="weight").model_dump())
    FedRCLParams(**FedRCLParams().model_dump())


def test_select_levels():
    names = ["a", "b", "c"]
    assert select_levels(names, None) == names
    assert select_levels(names, [-1]) == ["c"]
    assert select_levels(names, [2, 0, -1]) == ["a", "c"]
    with pytest.raises(ValueError, match="3 levels"):
        select_levels(names, [3])


# ---- the method: levels, hooks, local loss -----------------------------------------------------------

# name: (params, input shape, stages, level dims)
MODEL_CASES = {
    "cnn": (MODELS.get("cnn").params(), (1, 28, 28),
            [["0", "1", "2"], ["3", "4", "5", "6"], ["7", "8"]], [32, 64, 512]),
    "resnet10": (MODELS.get("resnet10").params(width=4), (3, 8, 8),
                 [["0", "1", "2"], ["3"], ["4"], ["5"], ["6", "7", "8"]], [4, 4, 8, 16, 32]),
    "mlp": (MODELS.get("mlp").params(), (1, 8, 8), [["0", "1", "2"], ["3", "4"]], [128, 64]),
}


def make_run(name):
    params, shape, _, _ = MODEL_CASES[name]
    spec = ModelSpec(shape, 3)
    torch.manual_seed(0)
    model = build_model(name, params, spec)
    return SimpleNamespace(model=model, layout=WeightLayout.of(model)), shape


def ctx():
    return ClientContext(client_id=0, round=1, data=[0] * 8, payload={}, state={})


def hook_count(model):
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def post_activation_levels(encoder, x, stages):
    """Each stage's output (its last child that is not a Flatten), running the children one by one."""
    last = {[n for n in names if not isinstance(encoder.get_submodule(n), torch.nn.Flatten)][-1] for names in stages}
    out, h = [], x
    for name, child in encoder.named_children():
        h = child(h)
        if name in last:
            out.append(level_representation(h))
    return out, h


def block_preactivation(block, x):
    """A BasicBlock's residual sum before its final ReLU."""
    out = block.bn2(block.conv2(F.relu(block.bn1(block.conv1(x)))))
    return out + block.shortcut(x)


def pre_activation_levels(name, encoder, x):
    """Written out per model: the input of each stage's last activation."""
    e, rep = encoder, level_representation
    if name == "cnn":
        a1 = e[0](x)
        a2 = e[3](e[2](F.relu(a1)))
        a3 = e[7](e[6](e[5](F.relu(a2))))
        return [rep(a1), rep(a2), rep(a3)], F.relu(a3)
    if name == "mlp":
        a1 = e[1](e[0](x))
        a2 = e[3](F.relu(a1))
        return [rep(a1), rep(a2)], F.relu(a2)
    if name == "resnet10":
        a0 = e[1](e[0](x))
        levels, h = [rep(a0)], F.relu(a0)
        for block in (e[3], e[4], e[5], e[6]):
            a = block_preactivation(block, h)
            levels.append(rep(a))
            h = F.relu(a)
        return levels, e[8](e[7](h))
    raise KeyError(name)


@pytest.mark.parametrize("name", sorted(MODEL_CASES))
def test_encoder_stages_of_each_model(name):
    run, shape = make_run(name)
    _, _, stages, dims = MODEL_CASES[name]
    assert encoder_stages(run.model.encoder) == stages
    x = torch.randn(3, *shape)
    run.model.eval()
    for feats, z in (post_activation_levels(run.model.encoder, x, stages),
                     pre_activation_levels(name, run.model.encoder, x)):
        assert [f.shape[1] for f in feats] == dims
        assert torch.allclose(z, run.model.encoder(x), atol=1e-5), "the reference passes reproduce z"
    post, z = post_activation_levels(run.model.encoder, x, stages)
    assert torch.allclose(post[-1], F.normalize(z, dim=1), atol=1e-6), "the last post-activation level is z"


@pytest.mark.parametrize("preactivation", [True, False])
@pytest.mark.parametrize("name", sorted(MODEL_CASES))
def test_tapped_levels_match_reference_passes(name, preactivation):
    run, shape = make_run(name)
    _, _, stages, _ = MODEL_CASES[name]
    tap = FeatureTap()
    tap.attach(run.model.encoder, stages, preactivation=preactivation)
    x = torch.randn(5, *shape)
    run.model.eval()
    z = run.model.encoder(x)
    got = tap.collect()
    tap.detach()
    want, z_ref = (pre_activation_levels(name, run.model.encoder, x) if preactivation
                   else post_activation_levels(run.model.encoder, x, stages))
    assert torch.allclose(z, z_ref, atol=1e-5)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert torch.allclose(g, w, atol=1e-5)
    if preactivation:  # pre-activation levels have negative entries; post-ReLU ones cannot
        assert any((g < 0).any() for g in got)


def test_collect_without_a_forward_pass_is_an_error():
    run, _ = make_run("mlp")
    tap = FeatureTap()
    tap.attach(run.model.encoder, MODEL_CASES["mlp"][2])
    with pytest.raises(RuntimeError, match="forward pass"):
        tap.collect()
    tap.detach()


@pytest.mark.parametrize("name", sorted(MODEL_CASES))
def test_local_loss_is_ce_plus_weighted_mean_over_levels(name):
    run, shape = make_run(name)
    p = FedRCLParams(lam=0.3, beta=2.0, tau=0.5, weight=0.7)
    method = FedRCL(p, run)
    run.model.train()
    c = ctx()
    state = method.begin_local(run.model, c)
    torch.manual_seed(4)
    x, y = torch.randn(6, *shape), labels(0, 1, 0, 1, 2, 2)
    loss = method.local_loss(run.model, x, y, c, state)
    loss.backward()  # in-place ReLUs right after tapped points must not break autograd

    with torch.no_grad():
        # In train mode both passes normalise resnet10's BatchNorm with the batch's own statistics.
        feats, z = pre_activation_levels(name, run.model.encoder, x)
        rcl = sum(relaxed_supcon_loss(f, y, 0.5, 2.0, 0.3) for f in feats) / len(feats)
        expected = F.cross_entropy(run.model.head(z), y) + 0.7 * rcl
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    assert rcl.item() > 0
    assert all(q.grad is not None for q in run.model.parameters())


def test_local_loss_under_lambda_role_weight_weighs_rcl_by_lambda_at_the_set_threshold():
    run, shape = make_run("mlp")
    method = FedRCL(FedRCLParams(lam=0.3, lambda_role="weight", threshold=0.2, beta=2.0, tau=0.5), run)
    run.model.train()
    c = ctx()
    state = method.begin_local(run.model, c)
    torch.manual_seed(4)
    x, y = torch.randn(6, *shape), labels(0, 1, 0, 1, 2, 2)
    with torch.no_grad():
        loss = method.local_loss(run.model, x, y, c, state)
        feats, z = pre_activation_levels("mlp", run.model.encoder, x)
        rcl = sum(relaxed_supcon_loss(f, y, 0.5, 2.0, 0.2) for f in feats) / len(feats)
        expected = F.cross_entropy(run.model.head(z), y) + 0.3 * rcl
    method._tap.detach()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    assert rcl.item() != pytest.approx((sum(relaxed_supcon_loss(f, y, 0.5, 2.0, 0.3) for f in feats) / 2).item())


def test_only_chosen_levels_are_tapped():
    run, shape = make_run("cnn")
    method = FedRCL(FedRCLParams(levels=[-1]), run)
    method.begin_local(run.model, ctx())
    assert hook_count(run.model) == 1 and len(run.model.encoder[8]._forward_pre_hooks) == 1
    method = FedRCL(FedRCLParams(levels=[-1], preactivation=False), run)
    method.begin_local(run.model, ctx())
    assert hook_count(run.model) == 2, "each method instance owns its tap"


def test_hooks_never_accumulate_and_are_gone_after_upload():
    run, shape = make_run("resnet10")
    method = FedRCL(FedRCLParams(), run)
    per_client = hook_count(run.model) + 1 + 4 * 1  # stem ReLU + the one (shared) ReLU of each block
    x, y = torch.randn(4, *shape), labels(0, 0, 1, 1)
    for _ in range(3):  # three clients on the one live model
        c = ctx()
        state = method.begin_local(run.model, c)
        assert hook_count(run.model) == per_client
        method.local_loss(run.model, x, y, c, state).backward()
        method.client_upload(run.model, c, state)
        assert hook_count(run.model) == 0
    # A client that failed before its upload leaves hooks; the next begin_local replaces them.
    method.begin_local(run.model, ctx())
    method.begin_local(run.model, ctx())
    assert hook_count(run.model) == per_client
    method.client_upload(run.model, ctx(), None)
    assert hook_count(run.model) == 0


def test_weight_zero_is_plain_cross_entropy():
    run, shape = make_run("mlp")
    method = FedRCL(FedRCLParams(weight=0.0), run)
    c = ctx()
    state = method.begin_local(run.model, c)
    x, y = torch.randn(5, *shape), labels(0, 0, 1, 1, 2)
    assert method.local_loss(run.model, x, y, c, state).item() == pytest.approx(F.cross_entropy(run.model(x), y).item())


def test_setup_rejects_a_level_the_encoder_lacks():
    run, _ = make_run("mlp")
    FedRCL(FedRCLParams(levels=[0, -1]), run).setup()
    with pytest.raises(ConfigError, match="2 levels"):
        FedRCL(FedRCLParams(levels=[5]), run).setup()
