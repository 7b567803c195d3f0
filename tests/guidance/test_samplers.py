"""Guided samplers: seeding, DDIM/DDPM, CFG, composed guidance (FedDISC Eq. 7), classifier guidance and
initial noise editing (FedCADO Eq. 3-5, Sec. 3.3), frozen weights, input validation."""
from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from diffusers import DDIMScheduler

from fedguide.config import GuidanceConfig
from fedguide.guidance.model import GuidanceModel
from fedguide.guidance.samplers import (Condition, SamplerConfig, as_eps, guided_eps, image_generators,
                                        initial_noise, sample, scaled_gradient)
from fedguide.guidance.tiny import IMAGE_EMBED, build_tiny_pipeline
from fedguide.registry import ConfigError

PROMPTS = ["a cat", "a dog", "a red car"]
FAST = SamplerConfig(steps=4, batch_size=3, progress=False)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> GuidanceModel:
    folder = build_tiny_pipeline(tmp_path_factory.mktemp("sd"), seed=0)
    return GuidanceModel.from_config(GuidanceConfig(model=str(folder), device="cpu"))


@pytest.fixture(scope="module")
def unclip(tmp_path_factory) -> GuidanceModel:
    folder = build_tiny_pipeline(tmp_path_factory.mktemp("unclip"), seed=1, unclip=True)
    return GuidanceModel.from_config(GuidanceConfig(model=str(folder), device="cpu"))


def image_labels(m: GuidanceModel, n: int, seed: int) -> torch.Tensor:
    embeds = torch.randn(n, IMAGE_EMBED, generator=torch.Generator().manual_seed(seed))
    return m.image_condition(embeds)


def squared_distance_to_grey(images: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return images.pow(2).flatten(1).mean(1)


# --- seeding -------------------------------------------------------------------------------------------
def test_same_seed_is_identical_and_batch_size_does_not_matter(model):
    first = sample(model, PROMPTS, FAST)
    again = sample(model, PROMPTS, FAST)
    one_by_one = sample(model, PROMPTS, replace(FAST, batch_size=1))
    assert first.images.shape == (3, 3, 32, 32) and first.images.dtype == torch.float32
    assert first.latents.shape == (3, 4, 8, 8) and first.latents.device.type == "cpu"
    assert first.images.min() >= -1 and first.images.max() <= 1
    assert torch.equal(first.images, again.images)
    torch.testing.assert_close(one_by_one.latents, first.latents, atol=1e-4, rtol=1e-4)
    assert first.images_per_second > 0 and first.seconds > 0 and first.edit_losses == []


def test_different_seeds_differ_and_noise_depends_on_seed_and_index_only(model):
    a = sample(model, PROMPTS[:2], replace(FAST, seed=0), decode=False)
    b = sample(model, PROMPTS[:2], replace(FAST, seed=1), decode=False)
    assert a.images is None
    assert not torch.allclose(a.latents, b.latents, atol=1e-3)
    noise = initial_noise(image_generators(0, [0, 1, 2]), (4, 8, 8))
    assert torch.equal(initial_noise(image_generators(0, [2]), (4, 8, 8))[0], noise[2])
    assert not torch.equal(noise[0], noise[1])


def test_given_initial_latents_are_used_as_they_are(model):
    noise = initial_noise(image_generators(0, range(2)), (4, 8, 8))
    own = sample(model, PROMPTS[:2], FAST, latents=noise, decode=False)
    default = sample(model, PROMPTS[:2], FAST, decode=False)
    assert torch.equal(own.latents, default.latents)  # init_noise_sigma is 1 for DDIM
    shifted = sample(model, PROMPTS[:2], FAST, latents=noise + 1, decode=False)
    assert not torch.allclose(shifted.latents, default.latents, atol=1e-3)


def test_ddpm_runs_and_its_step_noise_is_per_image(model):
    ddpm = replace(FAST, scheduler="ddpm", batch_size=2)
    a = sample(model, PROMPTS, ddpm, decode=False)
    b = sample(model, PROMPTS, replace(ddpm, batch_size=3), decode=False)
    ddim = sample(model, PROMPTS, FAST, decode=False)
    assert torch.isfinite(a.latents).all()
    torch.testing.assert_close(a.latents, b.latents, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(a.latents, ddim.latents, atol=1e-3)


# --- classifier-free and composed guidance -------------------------------------------------------------
def test_guidance_scale_one_skips_the_unconditional_pass(model, monkeypatch):
    batches = []
    real_eps = model.eps

    def counting_eps(latents, t, context, class_labels=None, **kw):
        batches.append(latents.shape[0])
        return real_eps(latents, t, context, class_labels=class_labels, **kw)

    monkeypatch.setattr(model, "eps", counting_eps)
    plain = sample(model, PROMPTS[:2], replace(FAST, guidance_scale=1.0), decode=False)
    assert batches == [2] * FAST.steps
    batches.clear()
    cfg = sample(model, PROMPTS[:2], replace(FAST, guidance_scale=3.0), decode=False)
    assert batches == [4] * FAST.steps  # conditional and unconditional in one call
    assert not torch.allclose(plain.latents, cfg.latents, atol=1e-3)


def test_zero_weights_equal_plain_cfg_and_a_weight_changes_the_images(unclip):
    labels = image_labels(unclip, 2, seed=5)
    plain = sample(unclip, PROMPTS[:2], FAST)
    zero = sample(unclip, PROMPTS[:2], FAST, conditions=[Condition(0.0, class_labels=labels),
                                                           Condition(0.0, class_labels=labels * 2)])
    assert torch.equal(plain.images, zero.images)
    composed = sample(unclip, PROMPTS[:2], FAST, conditions=[Condition(2.0, class_labels=labels)])
    assert not torch.allclose(plain.images, composed.images, atol=1e-3)
    # The documented unCLIP default: a zero image embedding at noise level 0 on every base pass.
    zeros = unclip.image_condition(torch.zeros(2, IMAGE_EMBED))
    explicit = sample(unclip, PROMPTS[:2], FAST, base_class_labels=zeros)
    assert torch.equal(plain.images, explicit.images)


def test_composed_guidance_is_cfg_plus_weighted_differences(unclip, monkeypatch):
    """ε(∅)=1, ε(C)=2, ε_1=3 (w 2), ε_2=5 (w 0.5), ε_3=9 (w −1, a context), ε_4=100 (w 0, never run):
    ε̂ = 1 + 3·(2−1) + 2·(3−2) + 0.5·(5−2) − (9−2) = 0.5 exactly."""
    n = 2
    width = unclip.unet.config.projection_class_embeddings_input_dim
    empty = unclip.empty_text(1).tokens[0]
    tokens = unclip.encode_text(PROMPTS[:n]).tokens
    by_label = {0.0: 2.0, 1.0: 3.0, 2.0: 5.0, 3.0: 100.0}
    calls, seen = [], []

    def fake_eps(latents, t, context, class_labels=None, **kw):
        calls.append(latents.shape[0])
        values = []
        for b in range(latents.shape[0]):
            if torch.equal(context[b], empty):
                values.append(1.0)
            elif context[b, 0, 0] == 7:
                values.append(9.0)
            else:
                values.append(by_label[float(class_labels[b, 0])])
        return torch.tensor(values)[:, None, None, None].expand_as(latents).clone()

    real_step = DDIMScheduler.step

    def recording_step(self, model_output, *args, **kw):
        seen.append(model_output.clone())
        return real_step(self, model_output, *args, **kw)

    monkeypatch.setattr(unclip, "eps", fake_eps)
    monkeypatch.setattr(DDIMScheduler, "step", recording_step)
    label = lambda v: torch.full((n, width), v)  # noqa: E731
    conditions = [Condition(2.0, class_labels=label(1.0)), Condition(0.5, class_labels=label(2.0)),
                  Condition(-1.0, context=torch.full_like(tokens, 7.0)), Condition(0.0, class_labels=label(3.0))]
    config = replace(FAST, steps=2, batch_size=n, guidance_scale=3.0)
    sample(unclip, PROMPTS[:n], config, conditions=conditions, base_class_labels=label(0.0), decode=False)
    assert calls == [5 * n] * 2  # C, ∅ and three nonzero conditions in one UNet call per step
    assert len(seen) == 2 and all(torch.equal(e, torch.full_like(e, 0.5)) for e in seen)


def test_guided_eps_formula():
    c, u, e1 = torch.tensor([2.0]), torch.tensor([1.0]), torch.tensor([4.0])
    assert torch.equal(guided_eps(c, None, 7.0), c)
    assert torch.equal(guided_eps(c, u, 3.0, [(0.5, e1)]), torch.tensor([1 + 3 * 1 + 0.5 * 2.0]))


def test_v_prediction_outputs_are_converted_to_eps():
    a = torch.tensor(0.64)
    fake = SimpleNamespace(scheduler_config={"prediction_type": "v_prediction"}, alpha_bar=lambda t: a)
    x0, eps = torch.randn(2, 4, 8, 8), torch.randn(2, 4, 8, 8)
    xt = a.sqrt() * x0 + (1 - a).sqrt() * eps
    v = a.sqrt() * eps - (1 - a).sqrt() * x0
    torch.testing.assert_close(as_eps(fake, v, xt, torch.tensor(10)), eps)
    fake.scheduler_config = {"prediction_type": "sample"}
    torch.testing.assert_close(as_eps(fake, x0, xt, torch.tensor(10)), eps)


# --- classifier guidance and noise editing (FedCADO) ---------------------------------------------------
def test_classifier_guidance_lowers_the_loss_of_the_final_images(model):
    seen_indices = []

    def loss(images, idx):
        seen_indices.append(idx.tolist())
        return squared_distance_to_grey(images, idx)

    unguided = sample(model, PROMPTS, FAST)
    guided = sample(model, PROMPTS, replace(FAST, loss_scale=1000.0), loss_fn=loss)
    before = squared_distance_to_grey(unguided.images, None).mean()
    after = squared_distance_to_grey(guided.images, None).mean()
    assert after < 0.9 * before
    assert seen_indices == [[0, 1, 2]] * FAST.steps


def test_noise_editing_lowers_its_loss_and_weights_stay_frozen(model):
    config = replace(FAST, edit_steps=3, edit_lr=100.0, batch_size=2)
    result = sample(model, PROMPTS, config, loss_fn=squared_distance_to_grey)
    assert len(result.edit_losses) == 3
    assert result.edit_losses[-1] < result.edit_losses[0]
    for module in (model.unet, model.vae, model.text_encoder):
        for p in module.parameters():
            assert not p.requires_grad and p.grad is None
    assert torch.is_grad_enabled()  # sample() leaves the grad mode as it found it


# --- validation ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("prompts, overrides, match", [
    ([], {}, "at least one prompt"),
    (PROMPTS, {"scheduler": "euler"}, "unknown sampler scheduler"),
    (PROMPTS, {"steps": 0}, "at least 1"),
    (PROMPTS, {"batch_size": 0}, "batch_size"),
    (PROMPTS, {"edit_steps": 2}, "pass loss_fn"),
    (PROMPTS, {"scheduler": "ddpm", "eta": 0.5}, "eta is a DDIM setting"),
])
def test_bad_config_raises(model, prompts, overrides, match):
    with pytest.raises(ConfigError, match=match):
        sample(model, prompts, replace(FAST, **overrides))


def test_bad_conditions_raise(model, unclip):
    labels = image_labels(unclip, 3, seed=0)
    with pytest.raises(ConfigError, match="one row per prompt"):
        sample(unclip, PROMPTS[:2], FAST, conditions=[Condition(1.0, class_labels=labels)])
    with pytest.raises(ConfigError, match="unCLIP"):
        sample(model, PROMPTS, FAST, conditions=[Condition(1.0, class_labels=labels)])
    with pytest.raises(ConfigError, match="unCLIP"):
        sample(model, PROMPTS, FAST, base_class_labels=labels)
    with pytest.raises(ConfigError, match="neither class_labels nor context"):
        sample(unclip, PROMPTS, FAST, conditions=[Condition(1.0)])
    with pytest.raises(ConfigError, match="latents must be"):
        sample(model, PROMPTS, FAST, latents=torch.zeros(2, 4, 8, 8))
    with pytest.raises(ConfigError, match="one loss per image"):
        sample(model, PROMPTS, FAST, loss_fn=lambda x, idx: x.pow(2).mean())


def _tiny_chain(x: torch.Tensor):
    """A float16 chain whose gradient (1e-8 per entry) underflows float16 unless the loss is scaled."""
    y = (x.half() * 1e-4) * 1e-4
    return y.float().sum(), "aux"


def test_scaled_gradient_recovers_a_float16_gradient_that_underflows_unscaled():
    x = torch.ones(5)
    leaf = x.clone().requires_grad_(True)
    (plain,) = torch.autograd.grad(_tiny_chain(leaf)[0], leaf)
    assert torch.all(plain == 0)  # what a plain float16 backward gives
    grad, aux = scaled_gradient(_tiny_chain, x, torch.float16)
    assert aux == "aux" and grad.dtype == torch.float32
    torch.testing.assert_close(grad, torch.full((5,), 1e-8), rtol=2e-3, atol=0)


def test_scaled_gradient_lowers_the_scale_on_overflow_and_reruns_the_objective():
    calls = []

    def big(x):  # d/dx = 10 in float16: scaled by 2^16 it overflows (> 65504), by 2^12 it does not
        calls.append(1)
        return (x.half() * 10).float().sum(), None

    grad, _ = scaled_gradient(big, torch.ones(3), torch.float16)
    assert len(calls) == 2 and torch.isfinite(grad).all()
    torch.testing.assert_close(grad, torch.full((3,), 10.0), rtol=1e-3, atol=0)


def test_scaled_gradient_in_float32_is_the_plain_gradient_in_one_call():
    calls = []

    def f(x):
        calls.append(1)
        return (x ** 2).sum(), None

    grad, _ = scaled_gradient(f, torch.tensor([1.0, -2.0]), torch.float32)
    assert len(calls) == 1 and torch.equal(grad, torch.tensor([2.0, -4.0]))
