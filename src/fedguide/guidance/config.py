"""The ``guidance:`` section of a config: which frozen text-to-image model and image encoder to load."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field


class GuidanceConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: Optional[str] = Field(
        "embedded", description="SD-layout pipeline: 'embedded' (fedguide's own small trained models, offline), a "
                                "hub id (runwayml/stable-diffusion-v1-5, stabilityai/stable-diffusion-2-1, "
                                "stabilityai/stable-diffusion-2-1-unclip) or a local folder of the same layout")
    revision: Optional[str] = Field(None, description="hub revision (branch, tag or commit) of a hub id")
    image_encoder: Optional[str] = Field(
        None, description="CLIP image encoder: a hub id or folder of a CLIPModel (zero-shot available) or a "
                          "CLIPVisionModelWithProjection; null = the pipeline's own image_encoder/ if it has one; "
                          "'none' = no image encoder")
    device: str = Field("auto", description="auto = cuda when available, else cpu")
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field(
        "auto", description="auto = float16 on a GPU, float32 on a CPU")
    feature_cache: Optional[str] = Field(
        None, description="folder of the feature cache; null = $FEDGUIDE_CACHE or ~/.cache/fedguide/features")
    rebuild: bool = Field(False, description="recompute cached features (fedguide run --rebuild)")

    def cache_dir(self) -> Path:
        if self.feature_cache:
            return Path(self.feature_cache).expanduser()
        return Path(os.environ.get("FEDGUIDE_CACHE", "~/.cache/fedguide/features")).expanduser()
