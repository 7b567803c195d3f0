"""What methods use to reach the guidance layer during a run: one frozen model per process, the
feature cache of the config, dataset pixels in the models' range, class prompts."""
from __future__ import annotations

from typing import Sequence

import torch

from fedguide.config import GuidanceConfig
from fedguide.guidance.store import FeatureStore

PROMPT = "a photo of a {}"
_MODELS: dict[tuple, object] = {}


def guidance_model(cfg: GuidanceConfig):
    """The GuidanceModel of ``cfg``, loaded once per process (frozen; methods share it)."""
    from fedguide.guidance.model import GuidanceModel

    key = (cfg.model, cfg.revision, cfg.image_encoder, cfg.device, cfg.dtype)
    if key not in _MODELS:
        _MODELS[key] = GuidanceModel.from_config(cfg)
    return _MODELS[key]


def feature_store(cfg: GuidanceConfig) -> FeatureStore:
    return FeatureStore(cfg.cache_dir())


def guidance_pixels(splits, x: torch.Tensor) -> torch.Tensor:
    """Dataset images (standardised by their source) -> [-1, 1], the range diffusion models and encoders take."""
    return splits.unit_images(x) * 2 - 1


def class_prompts(class_names: Sequence[str], template: str = PROMPT) -> list[str]:
    """One prompt per class, lower-cased as the embedded models were trained ("a photo of a t-shirt/top")."""
    return [template.format(name.lower()) for name in class_names]
