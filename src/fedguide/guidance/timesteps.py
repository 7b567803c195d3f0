"""The papers' noise timestep on another pipeline: ``t: paper``.

FedDifRC (Fig. 6, NDCR) and SemanticFL (Eq. 2) read Stable Diffusion 1.5's UNet features at t = 150, chosen for
SD's training schedule (scaled-linear betas 0.00085 to 0.012 over 1000 steps) on the latents of a 224 px input
(28 x 28 positions). The same t on a pipeline with fewer latent positions, or another schedule, is a different
amount of noise: the signal of an image is spread over fewer positions, so the same per-position
signal-to-noise ratio destroys more of it. The rule used here is the resolution shift of Hoogeboom, Heek and
Salimans 2023 ("simple diffusion", arXiv:2301.11093, Sec. 3.1: log SNR shifted by 2 log(64/d) for d x d
images, that is SNR scaled by the ratio of the numbers of positions), as SD3 does for its timestep shift (Esser
et al. 2024, Sec. 5.3.2): the matched step t' on the pipeline is the one whose SNR is nearest, in log SNR, to

    SNR_SD(150) * (28 * 28) / (the pipeline's latent positions).

On SD-1.5's schedule at 224 px this is t = 150 exactly; on the embedded model (8 x 8 latents) it is an earlier,
less noisy step. An integer t is used as it is.
"""
from __future__ import annotations

import math
from typing import Union

import torch

PAPER_T = 150
PAPER_POSITIONS = 28 * 28  # SD-1.5's latents of a 224 px input (VAE scale 8)
RULE = ("t: paper = the step whose SNR is nearest (log SNR) to SD-1.5's SNR at t = 150 times (28*28 / the "
        "pipeline's latent positions): the resolution shift of Hoogeboom et al. 2023, Sec. 3.1")


# SD-1.5's training schedule, as its scheduler config states it (the embedded models train on it too).
SD15_SCHEDULE = {"num_train_timesteps": 1000, "beta_schedule": "scaled_linear", "beta_start": 0.00085,
                 "beta_end": 0.012}


def sd15_alphas_cumprod() -> torch.Tensor:
    """SD-1.5's alpha-bar over its 1000 steps (scaled_linear: betas linear in sqrt), in float64."""
    s = SD15_SCHEDULE
    betas = torch.linspace(s["beta_start"] ** 0.5, s["beta_end"] ** 0.5, s["num_train_timesteps"],
                           dtype=torch.float64) ** 2
    return torch.cumprod(1.0 - betas, dim=0)


def log_snr(alphas_cumprod: torch.Tensor) -> torch.Tensor:
    a = alphas_cumprod.to(torch.float64)
    return torch.log(a) - torch.log1p(-a)


def paper_matched_t(alphas_cumprod: torch.Tensor, latent_positions: int, paper_t: int = PAPER_T,
                    paper_positions: int = PAPER_POSITIONS) -> int:
    """The pipeline's step (1 or later) matching SD-1.5's ``paper_t`` at ``paper_positions``, by the rule above."""
    target = float(log_snr(sd15_alphas_cumprod())[paper_t]) + math.log(paper_positions / latent_positions)
    gaps = (log_snr(alphas_cumprod)[1:] - target).abs()
    return int(torch.argmin(gaps)) + 1


def resolve_t(t: Union[int, str], alphas_cumprod: torch.Tensor, latent_positions: int) -> int:
    """A method's ``t`` option: an integer as it is, ``"paper"`` matched to the pipeline."""
    return t if isinstance(t, int) else paper_matched_t(alphas_cumprod, latent_positions)


def pipeline_t(t: Union[int, str], model, image_size: Union[int, None]) -> int:
    """``resolve_t`` for a loaded guidance model read at ``image_size`` px (None: the pipeline's own size)."""
    side = (image_size or model.image_size) // model.vae_scale
    return resolve_t(t, model.noise_scheduler.alphas_cumprod, side * side)


def t_note(t: Union[int, str], resolved: int) -> dict:
    """What a run records of its timestep: the option, the step used, and the rule that chose it."""
    return {"option": t, "resolved": resolved, "rule": RULE if t == "paper" else "the configured step"}
