"""Loading a Stable-Diffusion-layout pipeline (hub id, local folder or ``embedded``) into a GuidanceModel.

The top of the loading layers: ``sources`` resolves where a model is and fingerprints it,
``components`` reads its parts, ``model`` holds them. Nothing below imports this module, so it may
import all of them.
"""
from __future__ import annotations

from fedguide.config import GuidanceConfig
from fedguide.guidance.model import GuidanceModel


def load_guidance(cfg: GuidanceConfig) -> GuidanceModel:
    """Builds the GuidanceModel described by ``cfg`` (frozen, eval mode, on its device and dtype)."""
    return GuidanceModel.from_config(cfg)
