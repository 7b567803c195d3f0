"""``t: paper``: the papers' t = 150 on SD-1.5 at 224 px matched to a pipeline's latent positions by the resolution
shift of Hoogeboom et al. 2023 (arXiv:2301.11093, Sec. 3.1: log SNR + log(n_paper / n_pipeline))."""
from __future__ import annotations

import math

import pytest
import torch

from fedguide.guidance.timesteps import log_snr, paper_matched_t, pipeline_t, resolve_t, sd15_alphas_cumprod, t_note


def test_sd15s_own_schedule_at_224_px_gives_150_exactly():
    assert paper_matched_t(sd15_alphas_cumprod(), 28 * 28) == 150


def test_the_matched_step_on_8x8_latents_by_hand():
    # SD-1.5 at t = 150: alpha_bar = 0.827812, log SNR = ln(0.827812 / 0.172188) = 1.570197.
    # 8 x 8 latents hold 64 of the paper's 784 positions: target = 1.570197 + ln(784 / 64) = 4.075723.
    # On the same schedule log SNR(17) = 4.124852, (18) = 4.067597, (19) = 4.013116: 18 is nearest.
    a = sd15_alphas_cumprod()
    assert float(a[150]) == pytest.approx(0.827812, abs=1e-6)
    assert float(log_snr(a)[150]) + math.log(784 / 64) == pytest.approx(4.075723, abs=1e-6)
    assert [round(float(log_snr(a)[t]), 6) for t in (17, 18, 19)] == [4.124852, 4.067597, 4.013116]
    assert paper_matched_t(a, 64) == 18


def test_more_positions_need_more_noise_and_another_schedule_its_own_step():
    a = sd15_alphas_cumprod()
    assert paper_matched_t(a, 16 * 16) < 150 < paper_matched_t(a, 64 * 64)
    # A linear schedule keeps more signal early: the same SNR comes at another step, found on that schedule.
    linear = torch.cumprod(1 - torch.linspace(1e-4, 0.02, 1000, dtype=torch.float64), 0)
    t = paper_matched_t(linear, 28 * 28)
    target = float(log_snr(a)[150])
    assert abs(float(log_snr(linear)[t]) - target) <= abs(float(log_snr(linear)[t + 1]) - target)
    assert abs(float(log_snr(linear)[t]) - target) <= abs(float(log_snr(linear)[t - 1]) - target)


def test_an_integer_stays_an_integer_and_the_note_names_the_rule():
    assert resolve_t(150, sd15_alphas_cumprod(), 64) == 150
    assert t_note(150, 150)["rule"] == "the configured step"
    assert "Hoogeboom" in t_note("paper", 18)["rule"] and t_note("paper", 18)["resolved"] == 18


def test_the_embedded_pipeline_resolves_to_its_matched_step():
    from fedguide.config import GuidanceConfig
    from fedguide.guidance.shared import guidance_model

    model = guidance_model(GuidanceConfig())
    assert (model.latent_size, model.vae_scale) == (8, 4)
    assert pipeline_t("paper", model, None) == paper_matched_t(model.noise_scheduler.alphas_cumprod, 64) == 18
    # Read at 64 px the latents are 16 x 16: more positions, more noise.
    assert pipeline_t("paper", model, 64) == paper_matched_t(model.noise_scheduler.alphas_cumprod, 256) > 18


@pytest.mark.parametrize("method", ["feddifrc", "semanticfl"])
def test_t_zero_reads_clean_latents_and_a_negative_step_is_refused(method):
    """t = 0 is a step of the timestep study (clean latents: features.py adds no noise at 0); below 0 is refused."""
    from fedguide.methods import METHODS

    params = METHODS.get(method).params
    assert params(t=0).t == 0 and resolve_t(0, sd15_alphas_cumprod(), 64) == 0
    with pytest.raises(ValueError, match="greater than or equal to 0"):
        params(t=-1)
