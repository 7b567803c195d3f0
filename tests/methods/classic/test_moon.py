"""MOON's model-contrastive loss on hand-computed cases, and the method's use of its frozen models."""
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from fedguide.core.weights import WeightLayout
from fedguide.methods import METHODS, ClientContext
from fedguide.methods.classic.moon import Moon, MoonParams, moon_contrastive_loss
from fedguide.models import MODELS, ModelSpec, build_model


def t(rows):
    return torch.tensor(rows, dtype=torch.float32)


# ---- the loss ---------------------------------------------------------------------------------------

def test_value_hand_computed():
    # sim(z, z_glob) = 0.6, sim(z, z_prev) = 0, tau = 0.5: -log(e^1.2 / (e^1.2 + e^0)) = log(1 + e^-1.2)
    value = moon_contrastive_loss(t([[1, 0]]), t([[0.6, 0.8]]), t([[0, 1]]), 0.5)
    assert value.dim() == 0
    assert value.item() == pytest.approx(math.log(1 + math.exp(-1.2)), rel=1e-6)
    assert value.item() == pytest.approx(0.263282, abs=1e-6)


def test_similarity_is_cosine_not_dot_product():
    # Same directions as above, other lengths: the same value.
    value = moon_contrastive_loss(t([[2, 0]]), t([[3, 4]]), t([[0, 5]]), 0.5)
    assert value.item() == pytest.approx(math.log(1 + math.exp(-1.2)), rel=1e-6)


def test_batch_mean_of_per_sample_terms():
    z = t([[1, 0], [0, 1]])
    z_glob = t([[0.6, 0.8], [0, 1]])   # sims 0.6 and 1
    z_prev = t([[0, 1], [1, 0]])       # sims 0 and 0
    tau = 0.5
    first = math.log(1 + math.exp((0 - 0.6) / tau))
    second = math.log(1 + math.exp((0 - 1.0) / tau))
    assert moon_contrastive_loss(z, z_glob, z_prev, tau).item() == pytest.approx((first + second) / 2, rel=1e-6)


def test_temperature_scales_the_margin():
    # With sims 0.6 (pos) and 0 (neg): log(1 + e^(-0.6/tau)).
    for tau in (0.1, 0.5, 2.0):
        value = moon_contrastive_loss(t([[1, 0]]), t([[0.6, 0.8]]), t([[0, 1]]), tau)
        assert value.item() == pytest.approx(math.log(1 + math.exp(-0.6 / tau)), rel=1e-5)


def test_previous_equal_to_global_gives_log2_and_no_gradient():
    # Why a first participation can skip the term: with the global model as "previous", the two
    # logits coincide, the loss is the constant log 2 and its gradient vanishes.
    torch.manual_seed(0)
    z = torch.randn(5, 4, requires_grad=True)
    z_glob = torch.randn(5, 4)
    value = moon_contrastive_loss(z, z_glob, z_glob.clone(), 0.5)
    assert value.item() == pytest.approx(math.log(2), rel=1e-6)
    value.backward()
    assert torch.allclose(z.grad, torch.zeros_like(z), atol=1e-7)


def test_gradient_pulls_to_global_and_pushes_from_previous():
    torch.manual_seed(1)
    z = torch.randn(8, 6, requires_grad=True)
    z_glob, z_prev = torch.randn(8, 6), torch.randn(8, 6)
    moon_contrastive_loss(z, z_glob, z_prev, 0.5).backward()
    with torch.no_grad():
        stepped = z - 0.05 * z.grad
        assert (F.cosine_similarity(stepped, z_glob) > F.cosine_similarity(z, z_glob)).all()
        assert (F.cosine_similarity(stepped, z_prev) < F.cosine_similarity(z, z_prev)).all()


def test_stable_at_small_temperature():
    # sims -1 (pos) and +1 (neg) at tau = 0.001: log(1 + e^2000) ~ 2000, no overflow.
    value = moon_contrastive_loss(t([[1, 0]]), t([[-1, 0]]), t([[1, 0]]), 0.001)
    assert math.isfinite(value.item())
    assert value.item() == pytest.approx(2000.0, rel=1e-6)


def test_params_defaults_and_validation():
    p = MoonParams()
    assert (p.mu, p.tau) == (1.0, 0.5)
    assert METHODS.get("moon").params is MoonParams
    with pytest.raises(ValueError):
        MoonParams(mu=-1)
    with pytest.raises(ValueError):
        MoonParams(tau=0)
    with pytest.raises(ValueError):
        MoonParams(projection="mlp")


# ---- the method -------------------------------------------------------------------------------------

def make_run(name="mlp", params=None, shape=(1, 8, 8)):
    spec = ModelSpec(shape, 3)
    params = params or MODELS.get(name).params()

    def make_model():
        return build_model(name, params, spec)

    torch.manual_seed(0)
    model = make_model()
    layout = WeightLayout.of(model)
    return SimpleNamespace(model=model, make_model=make_model, layout=layout), shape


def other_weights(run, seed):
    torch.manual_seed(seed)
    return run.layout.flatten(run.make_model())


def ctx_for(run, payload_weights, state):
    return ClientContext(client_id=0, round=2, data=[0] * 10, payload={"weights": payload_weights}, state=state)


def test_first_participation_is_plain_cross_entropy():
    run, shape = make_run()
    method = Moon(MoonParams(), run)
    g = run.layout.flatten(run.model)
    ctx = ctx_for(run, g, {})
    state = method.begin_local(run.model, ctx)
    x, y = torch.randn(6, *shape), torch.tensor([0, 1, 2, 0, 1, 2])
    got = method.local_loss(run.model, x, y, ctx, state).item()
    assert got == pytest.approx(F.cross_entropy(run.model(x), y).item())
    assert method._glob is None, "no frozen model is built when there is no previous model"


@pytest.mark.parametrize("name, params, shape", [
    ("mlp", None, (1, 8, 8)),
    ("resnet10", MODELS.get("resnet10").params(width=4), (3, 8, 8)),  # BatchNorm: frozen models in eval mode
])
def test_loss_is_ce_plus_mu_times_contrast_with_frozen_models(name, params, shape):
    run, shape = make_run(name, params, shape)
    mu, tau = 0.7, 0.4
    method = Moon(MoonParams(mu=mu, tau=tau), run)
    glob_w, prev_w = other_weights(run, 1), other_weights(run, 2)
    run.layout.load(run.model, glob_w)  # local training starts from the global weights
    run.model.train()
    ctx = ctx_for(run, glob_w, {"prev_weights": prev_w})
    state = method.begin_local(run.model, ctx)

    # Reference: independent eval-mode copies with the global and previous weights.
    ref_glob, ref_prev = run.make_model().eval(), run.make_model().eval()
    run.layout.load(ref_glob, glob_w)
    run.layout.load(ref_prev, prev_w)
    torch.manual_seed(3)
    x, y = torch.randn(6, *shape), torch.tensor([0, 1, 2, 0, 1, 2])
    with torch.no_grad():
        z, logits = run.model.forward_features(x)
        expected = F.cross_entropy(logits, y) + mu * moon_contrastive_loss(z, ref_glob.encoder(x), ref_prev.encoder(x), tau)
    loss = method.local_loss(run.model, x, y, ctx, state)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)

    loss.backward()
    glob, prev = state.glob, state.prev
    for frozen in (glob, prev):
        assert not frozen.training
        assert all(p.grad is None and not p.requires_grad for p in frozen.parameters())
    assert all(p.grad is not None for p in run.model.parameters())
    # The frozen models hold exactly the payload's and the stored weights.
    assert torch.equal(run.layout.flatten(glob), glob_w)
    assert torch.equal(run.layout.flatten(prev), prev_w)


def test_frozen_models_are_built_once_and_leave_the_rng_alone():
    run, _ = make_run()
    method = Moon(MoonParams(), run)
    g = run.layout.flatten(run.model)
    ctx1 = ctx_for(run, g, {"prev_weights": other_weights(run, 1)})
    torch.manual_seed(5)
    before = torch.get_rng_state()
    method.begin_local(run.model, ctx1)  # builds the two frozen models
    assert method._glob is not None
    assert torch.equal(torch.get_rng_state(), before), "building the frozen models must not consume the global RNG"
    first = (method._glob, method._prev)
    ctx2 = ctx_for(run, other_weights(run, 4), {"prev_weights": other_weights(run, 6)})
    method.begin_local(run.model, ctx2)
    assert method._glob is first[0] and method._prev is first[1]
    assert torch.equal(run.layout.flatten(method._prev), ctx2.state["prev_weights"])


def test_upload_keeps_the_local_model_as_the_next_previous():
    run, _ = make_run()
    method = Moon(MoonParams(), run)
    ctx = ctx_for(run, run.layout.flatten(run.model), {})
    state = method.begin_local(run.model, ctx)
    with torch.no_grad():
        next(run.model.parameters()).add_(1.0)
    upload = method.client_upload(run.model, ctx, state)
    assert ctx.state_dirty
    assert torch.equal(ctx.state["prev_weights"], run.layout.flatten(run.model))
    assert torch.equal(upload["weights"], ctx.state["prev_weights"])
    assert upload["num_samples"] == 10
    assert set(upload) == {"weights", "num_samples"}, "the previous model never leaves the client"


def test_mu_zero_is_fedavg_and_keeps_no_state():
    run, shape = make_run()
    method = Moon(MoonParams(mu=0.0), run)
    ctx = ctx_for(run, run.layout.flatten(run.model), {"prev_weights": other_weights(run, 1)})
    state = method.begin_local(run.model, ctx)
    assert state is None
    x, y = torch.randn(4, *shape), torch.tensor([0, 1, 2, 0])
    got = method.local_loss(run.model, x, y, ctx, state).item()
    assert got == pytest.approx(F.cross_entropy(run.model(x), y).item())
    method.client_upload(run.model, ctx, state)
    assert not ctx.state_dirty
