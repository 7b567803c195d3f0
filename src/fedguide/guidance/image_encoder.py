"""CLIP image encoders: image embeddings, and zero-shot classification where a text tower is aligned.

``load_image_encoder`` takes a hub id or folder holding either a full ``CLIPModel`` (both towers and their
projections: embeddings and zero-shot) or a ``CLIPVisionModelWithProjection`` (the unCLIP pipelines'
image_encoder/: embeddings only). Images arrive in [-1, 1] and are resized and normalised in torch with
the checkpoint's own preprocessing statistics (so the step is batched, on the device, and
differentiable); the PIL-based CLIPImageProcessor would round-trip every image through the CPU.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F

from fedguide.guidance.sources import MODEL_FILES, GuidanceLoadError, resolve_source
from fedguide.registry import ConfigError

# OpenAI CLIP's preprocessing statistics, used when a checkpoint ships no preprocessor_config.json.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


class ClipImageEncoder:
    def __init__(self, vision, text=None, tokenizer=None, mean=CLIP_MEAN, std=CLIP_STD, source: str = "",
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
        self.device, self.dtype, self.source = torch.device(device), dtype, source
        self.vision = vision.to(self.device, dtype).eval().requires_grad_(False)
        self.text = text.to(self.device, dtype).eval().requires_grad_(False) if text is not None else None
        self.tokenizer = tokenizer
        self.mean = torch.tensor(mean, device=self.device, dtype=dtype).view(1, 3, 1, 1)
        self.std = torch.tensor(std, device=self.device, dtype=dtype).view(1, 3, 1, 1)
        self.size = int(vision.config.image_size if hasattr(vision.config, "image_size")
                        else vision.config.vision_config.image_size)

    @property
    def dim(self) -> int:
        return int(self.vision.config.projection_dim)

    @property
    def can_zero_shot(self) -> bool:
        return self.text is not None

    def preprocess(self, x: torch.Tensor) -> torch.Tensor:
        return encoder_pixels(x, self.size, self.mean, self.std)

    def embed(self, x: torch.Tensor, normalize: bool = False) -> torch.Tensor:
        """Projected image embeddings [B, D] (L2-normalised if asked)."""
        out = self.vision(pixel_values=self.preprocess(x))
        emb = out.image_embeds
        return F.normalize(emb, dim=-1) if normalize else emb

    @torch.no_grad()
    def embed_text(self, prompts: Sequence[str], normalize: bool = True) -> torch.Tensor:
        if not self.can_zero_shot:
            raise ConfigError(f"image encoder '{self.source}' has no aligned text tower; zero-shot needs a full "
                              "CLIP model, e.g. guidance.image_encoder=openai/clip-vit-large-patch14")
        enc = self.tokenizer(list(prompts), padding=True, truncation=True, return_tensors="pt").to(self.device)
        emb = self.text(input_ids=enc.input_ids, attention_mask=enc.attention_mask).text_embeds
        return F.normalize(emb, dim=-1) if normalize else emb

    @torch.no_grad()
    def zero_shot(self, x: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        """Cosine similarities [B, len(prompts)] between images and prompts (argmax = predicted class)."""
        return self.embed(x, normalize=True) @ self.embed_text(prompts).T


def encoder_pixels(x: torch.Tensor, size: int, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """Images in [-1, 1] ([B, 1 or 3, H, W]) as an encoder takes them: RGB, ``size`` x ``size`` (bicubic),
    standardised by its ``mean`` and ``std`` ([1, 3, 1, 1], whose device and dtype they take)."""
    if x.ndim != 4 or x.shape[1] not in (1, 3):
        raise ConfigError(f"images must be [B, 3, H, W] in [-1, 1], got shape {tuple(x.shape)}")
    x = x.to(mean.device, mean.dtype).expand(-1, 3, -1, -1)
    x = F.interpolate(x, size=(size, size), mode="bicubic", align_corners=False)
    return ((x + 1) / 2 - mean) / std


def preprocessor_stats(files: Sequence[Path], mean: tuple[float, ...], std: tuple[float, ...]
                       ) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(image_mean, image_std) of the first preprocessor_config.json of ``files`` there, else the defaults."""
    for f in files:
        if f.is_file():
            cfg = json.loads(f.read_text())
            return tuple(cfg.get("image_mean", mean)), tuple(cfg.get("image_std", std))
    return mean, std


def _stats(folder: Path) -> tuple[tuple[float, ...], tuple[float, ...]]:
    return preprocessor_stats([folder / "preprocessor_config.json",
                               folder.parent / "feature_extractor" / "preprocessor_config.json"], CLIP_MEAN, CLIP_STD)


def load_image_encoder(source: str, revision: str | None, device: torch.device, dtype: torch.dtype) -> ClipImageEncoder:
    from transformers import AutoConfig, AutoTokenizer, CLIPModel, CLIPVisionModelWithProjection

    folder = resolve_source(source, revision, allow=MODEL_FILES)
    try:
        config = AutoConfig.from_pretrained(folder)
        mean, std = _stats(folder)
        if config.model_type == "clip":
            full = CLIPModel.from_pretrained(folder, dtype=dtype)
            # The two towers with their projections, as separate modules (vision: image_embeds).
            from transformers import CLIPTextModelWithProjection

            vision = CLIPVisionModelWithProjection(config.vision_config)
            vision.vision_model, vision.visual_projection = full.vision_model, full.visual_projection
            vision.config.projection_dim = config.projection_dim
            text = CLIPTextModelWithProjection(config.text_config)
            text.text_model, text.text_projection = full.text_model, full.text_projection
            return ClipImageEncoder(vision, text, AutoTokenizer.from_pretrained(folder), mean, std, source, device, dtype)
        vision = CLIPVisionModelWithProjection.from_pretrained(folder, dtype=dtype)
        return ClipImageEncoder(vision, None, None, mean, std, source, device, dtype)
    except (OSError, ValueError) as err:
        raise GuidanceLoadError(f"image encoder '{source}' ({folder}) cannot be read as a CLIP model: {err}; pass a "
                                "CLIPModel or CLIPVisionModelWithProjection folder, or guidance.image_encoder=none") from None
