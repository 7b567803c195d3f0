"""FedDISC's Eq. 5 noising of the uploaded features, z̄ = √ᾱ_n·z + √(1−ᾱ_n)·ε, as one of two noise
processes, and the (ε, δ) each gives (``method.noise_process``).

- ``unclip`` (the authors' released code, MingzhaoYang/FedDISC sdmodel.py ``noise_image_embeddings`` and
  server.py, with SD-2.1-unCLIP): a feature is mapped to the image encoder's embedding scale (times the
  public factor c that the server sends with its prototypes, see _centroids.py), standardised by the
  pipeline's image normaliser, noised by the pipeline's image-noising scheduler (``add_noise``) at level n,
  unstandardised and mapped back by 1/c for the upload. The server conditions the UNet on it (times c)
  together with the level's embedding (the unCLIP class input), as the pipeline does for an embedding it
  noised itself. ᾱ_n is read from the loaded image-noising scheduler.
- ``unet_schedule``: Eq. 5 on the features themselves with ᾱ_n of the UNet's training schedule (the
  scheduler/ config); the server tells an unCLIP UNet the embedding is clean (level 0). The reading for
  token-conditioned models such as the embedded ones, which have no image-noising scheduler.
- ``auto`` (default): ``unclip`` on an unCLIP pipeline, else ``unet_schedule``.

The released code's clients noise every sample at level 500 before k-means and its server noises the
centroids again at 200 and averages the two level embeddings; FedDISC's Eq. 5 and the paper's n = 200
describe one noising by the client, the default here; feddisc's ``schedule: released``
(_released_schedule.py) runs the released two-level schedule with these same processes.

Privacy: ``unet_schedule`` is ``noised_mean_privacy`` (Δ = 2B√ᾱ/m, σ = √(1−ᾱ)); ``unclip`` is
``standardised_noised_mean_privacy`` (Δ = 2Bc√ᾱ/(m·min σ_normaliser)), both in guidance/privacy.py.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

import torch

from fedguide.guidance.privacy import GaussianPrivacy, noised_mean_privacy, standardised_noised_mean_privacy
from fedguide.registry import ConfigError

NoiseProcess = Literal["auto", "unclip", "unet_schedule"]
SCHEDULE_KEYS = ("beta_schedule", "beta_start", "beta_end", "num_train_timesteps")


def resolve_process(requested: NoiseProcess, unclip: bool) -> str:
    """``auto`` -> the pipeline's own process; ``unclip`` on a pipeline without unCLIP parts is refused."""
    if requested == "auto":
        return "unclip" if unclip else "unet_schedule"
    if requested == "unclip" and not unclip:
        raise ConfigError("method.noise_process=unclip needs an unCLIP pipeline (image_normalizer/, "
                          "image_noising_scheduler/ and a UNet with a projection class embedding, e.g. "
                          "stabilityai/stable-diffusion-2-1-unclip); this one has none: use noise_process=auto "
                          "or unet_schedule")
    return requested


def noise_features(z: torch.Tensor, alpha_bar: float, generator: torch.Generator) -> torch.Tensor:
    """Eq. 5: z̄ = √ᾱ·z + √(1−ᾱ)·ε, ε ~ N(0, I)."""
    eps = torch.randn(z.shape, generator=generator, dtype=torch.float32)
    return math.sqrt(alpha_bar) * z.float() + math.sqrt(1.0 - alpha_bar) * eps


def _schedule(config) -> dict[str, Any]:
    return {key: config[key] for key in SCHEDULE_KEYS if key in config}


@dataclass(frozen=True)
class FeatureNoise:
    """One noise process at one level: ``apply`` noises features, ``privacy`` gives its (ε, δ)."""

    process: str  # "unclip" or "unet_schedule"
    level: int
    alpha_bar: float
    schedule: dict = field(default_factory=dict)  # the scheduler config ᾱ comes from
    scale: float = 1.0  # unclip: c, features -> the image encoder's embedding scale
    model: Optional[Any] = field(default=None, repr=False, compare=False)  # unclip: the GuidanceModel

    @classmethod
    def of(cls, process: str, model, level: int, scale: float = 1.0) -> "FeatureNoise":
        """The process on ``model`` at ``level``; ᾱ and the schedule read from the loaded scheduler."""
        if process == "unclip":
            return cls("unclip", level, model.image_noise_alpha_bar(level),
                       {"scheduler": "image_noising_scheduler", **_schedule(model.image_noising_scheduler.config)},
                       float(scale), model)
        if not 0 <= level < model.num_train_timesteps:
            raise ConfigError(f"noise_level {level} exceeds the guidance model's {model.num_train_timesteps} "
                              "timesteps; choose a smaller method.noise_level")
        return cls("unet_schedule", level, float(model.alpha_bar(level)),
                   {"scheduler": "scheduler", **_schedule(model.noise_scheduler.config)})

    @property
    def std_min(self) -> float:
        """The image normaliser's smallest per-coordinate std (unclip)."""
        return float(self.model.image_normalizer.std.detach().float().min())

    def apply(self, z: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """z̄ of features z [N, D] (float32, CPU); ε drawn from ``generator`` the same way for both processes."""
        if self.process == "unet_schedule":
            return noise_features(z, self.alpha_bar, generator)
        eps = torch.randn(z.shape, generator=generator, dtype=torch.float32)
        if len(z) == 0:
            return z.float()
        noised = self.model.noise_image_embeds(z.float() * self.scale, self.level, noise=eps)
        return noised.float().cpu() / self.scale

    def privacy(self, norm_bound: float, count: int, delta: float) -> GaussianPrivacy:
        if self.process == "unet_schedule":
            return noised_mean_privacy(self.alpha_bar, norm_bound, count, delta)
        return standardised_noised_mean_privacy(self.alpha_bar, norm_bound, self.scale, self.std_min, count, delta)

    def describe(self, norm_bound: float) -> dict[str, Any]:
        """What the privacy report says about the process."""
        out: dict[str, Any] = {"noise_process": self.process, "noise_schedule": self.schedule}
        if self.process == "unclip":
            out.update(condition_scale=self.scale, normalizer_std_min=self.std_min,
                       standardised_norm_bound=norm_bound * self.scale / self.std_min)
        return out
