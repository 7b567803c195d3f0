"""The settings of a pretraining run, checked when they are made, and which of them each stage's
result depends on (a finished stage is reused only while those are unchanged)."""
from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass
from typing import Optional

PROMPT = "a photo of a {}"
DATASETS = ("fmnist", "digits_domains")
REPA_TARGETS = ("effnet", "clip")
REPA_HEADS = ("mlp", "linear")
_BLOCK = re.compile(r"^(down|up)\.(\d+)$|^mid$")  # the UNet block names of guidance/hooks.py


@dataclass
class PretrainSettings:
    seed: int = 0
    public_fraction: float = 0.1
    public_seed: int = 0
    max_length: int = 16  # prompt tokens (the longest class prompt is 11)
    clip_epochs: int = 60
    clip_batch: int = 256
    clip_lr: float = 1e-3
    # Per dataset in DATASETS order: random views (affine + colour) of each public image added to the
    # CLIP stage's training set; the UNet's image tokens stay those of the images themselves.
    clip_augmented_views: tuple[int, ...] = (0, 31)
    # The frozen backbone's input side; cost grows with its square. At 128 px the CLIP stage names 72 % of
    # digits_domains' test images (64 px: 66 %), and the image-conditioned samples follow its embedding.
    clip_image_size: int = 128
    vae_steps: int = 2000
    vae_batch: int = 64
    vae_lr: float = 1e-3
    vae_kl: float = 1e-4
    unet_steps: int = 6000
    unet_batch: int = 128
    unet_lr: float = 3e-4
    unet_channels: tuple[int, ...] = (64, 128, 128, 128)
    ema_decay: float = 0.999
    p_drop_text: float = 0.1
    p_drop_image: float = 0.5
    unet_dataset_share: Optional[tuple[float, ...]] = (0.65, 0.35)  # per dataset in DATASETS order; None: uniform
    max_per_class: Optional[int] = None  # a smaller pool for quick checks (the shipped models use all of it)
    checkpoint_every: int = 250  # UNet steps between checkpoints of a run that may be killed
    # Representation alignment (REPA) of the UNet's hidden states, see repa.py; 0 trains without it.
    repa_weight: float = 0.0
    repa_layers: tuple[str, ...] = ("mid", "up.1")  # UNet blocks aligned (hook names: down.i, mid, up.i)
    repa_target: str = "effnet"  # "effnet": the frozen backbone's feature map; "clip": the mini-CLIP embedding
    repa_head: str = "mlp"  # "mlp": REPA's per-position MLP; "linear": one 1x1 convolution (see repa.py)

    def __post_init__(self):
        views = self.clip_augmented_views
        if len(views) != len(DATASETS) or min(views) < 0:
            raise ValueError(f"clip_augmented_views needs one count >= 0 per dataset {DATASETS}, got {tuple(views)}")
        if not 32 <= self.clip_image_size <= 512:
            raise ValueError(f"clip_image_size must be within [32, 512] px, got {self.clip_image_size}")
        share = self.unet_dataset_share
        # Checked here, not when the UNet stage starts an hour into a run.
        if share is not None and (len(share) != len(DATASETS) or min(share) < 0 or abs(sum(share) - 1) > 1e-6):
            raise ValueError(f"unet_dataset_share needs one non-negative share per dataset {DATASETS} summing to 1 "
                             f"(or None for uniform batches), got {tuple(share)}")
        channels = tuple(self.unet_channels)
        # 8 x 8 latents halve at each level but the last; GroupNorm(16) and 8-channel attention heads.
        if not 2 <= len(channels) <= 4 or any(c <= 0 or c % 16 for c in channels):
            raise ValueError(f"unet_channels needs 2 to 4 levels of positive multiples of 16 channels, got {channels}")
        self._check_repa()

    def _check_repa(self) -> None:
        if not (math.isfinite(self.repa_weight) and self.repa_weight >= 0):
            raise ValueError(f"repa_weight must be a finite number >= 0 (0: no alignment), got {self.repa_weight}")
        if self.repa_target not in REPA_TARGETS:
            raise ValueError(f"repa_target must be one of {REPA_TARGETS}, got {self.repa_target!r}")
        if self.repa_head not in REPA_HEADS:
            raise ValueError(f"repa_head must be one of {REPA_HEADS}, got {self.repa_head!r}")
        levels = len(self.unet_channels)
        if not self.repa_layers or not all(_is_block(name, levels) for name in self.repa_layers):
            raise ValueError(f"repa_layers needs UNet blocks among mid, down.0..down.{levels - 1}, "
                             f"up.0..up.{levels - 1}, got {tuple(self.repa_layers)}")


def _is_block(name: str, levels: int) -> bool:
    found = _BLOCK.match(name)
    return found is not None and (name == "mid" or int(found.group(2)) < levels)


def stage_key(settings: PretrainSettings, *prefixes: str) -> dict:
    """The settings a stage's result depends on (data and its own hyper-parameters)."""
    common = ("seed", "public_fraction", "public_seed", "max_length", "max_per_class")
    return {k: v for k, v in asdict(settings).items() if k in common or k.startswith(prefixes)}
