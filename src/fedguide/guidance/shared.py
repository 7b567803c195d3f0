"""What methods use to reach the guidance layer during a run: one frozen model per process, the
feature cache of the config, dataset pixels in the models' range, class prompts, and the checks and record
of a source trained on labeled images of the run's dataset (the oracle, a diagnostic: guidance/oracle)."""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from fedguide.config import GuidanceConfig
from fedguide.guidance.oracle import GENERATION_REFUSED
from fedguide.guidance.oracle import NAME as ORACLE
from fedguide.guidance.store import FeatureStore
from fedguide.registry import ConfigError

PROMPT = "a photo of a {}"
_MODELS: dict[tuple, object] = {}


def guidance_model(cfg: GuidanceConfig, run=None):
    """The GuidanceModel of ``cfg``, loaded once per process (frozen; methods share it). ``run``: the run whose
    data a data-trained source is made from: ``guidance.model: oracle`` (a diagnostic, guidance/oracle), which
    answers the same calls; a pipeline does not read it."""
    from fedguide.guidance.model import GuidanceModel

    if cfg.model == ORACLE:
        from fedguide.guidance.oracle.loading import oracle_model

        return oracle_model(cfg, run)
    key = (cfg.model, cfg.revision, cfg.image_encoder, cfg.device, cfg.dtype)
    if key not in _MODELS:
        _MODELS[key] = GuidanceModel.from_config(cfg)
    return _MODELS[key]


def source_record(cfg: GuidanceConfig, run) -> Optional[dict]:
    """What a run's guidance record notes of a data-trained source this process holds for ``run`` (the oracle:
    its network, pool and accuracies); None for a pipeline, whose fingerprint keys the caches."""
    if cfg.model != ORACLE:
        return None
    from fedguide.guidance.oracle.loading import loaded_oracle

    oracle = loaded_oracle(cfg, run)
    return None if oracle is None else oracle.record


def require_generation(cfg: GuidanceConfig, who: str) -> None:
    """A ConfigError naming the fix when ``who`` generates images and ``cfg``'s source cannot (the oracle)."""
    if cfg.model == ORACLE:
        raise ConfigError(GENERATION_REFUSED.format(who=who))


def feature_store(cfg: GuidanceConfig) -> FeatureStore:
    return FeatureStore(cfg.cache_dir())


def guidance_pixels(splits, x: torch.Tensor) -> torch.Tensor:
    """Dataset images (standardised by their source) -> [-1, 1], the range diffusion models and encoders take."""
    return splits.unit_images(x) * 2 - 1


def class_prompts(class_names: Sequence[str], template: str = PROMPT) -> list[str]:
    """One prompt per class, lower-cased as the embedded models were trained ("a photo of a t-shirt/top")."""
    return [template.format(name.lower()) for name in class_names]
