"""The embedded mini CLIP: frozen EfficientNet-Lite0 features projected into MiniLM's sentence space.

Only the projection (a two-layer MLP, 1280 -> 768 -> 384) is trained (pretrain/clip_stage.py), contrastively
against the frozen MiniLM embeddings of "a photo of a {class}" prompts; the text side is MiniLM's own
sentence embedding (masked mean of its token states), so zero-shot classification is the cosine between
a projected image and each prompt. It has the interface of ``ClipImageEncoder``.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from fedguide.guidance.embedded.backbones import IMAGE_FEATURES, IMAGE_SIZE, ImageBackbone
from fedguide.registry import ConfigError


class Projection(torch.nn.Module):
    def __init__(self, in_dim: int = IMAGE_FEATURES, hidden: int = 768, out_dim: int = 384):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(in_dim, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, out_dim))
        self.config = {"in_dim": in_dim, "hidden": hidden, "out_dim": out_dim}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def mean_pool(tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The sentence-transformers pooling: the mean of the token states over real tokens."""
    mask = mask.to(tokens.dtype)[..., None]
    return (tokens * mask).sum(1) / mask.sum(1).clamp_min(1)


class EmbeddedClip:
    def __init__(self, projection: Projection, text_encoder, tokenizer, backbone: ImageBackbone | None = None,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, source: str = "embedded"):
        self.device, self.dtype, self.source = torch.device(device), dtype, source
        self.backbone = (backbone or ImageBackbone()).to(self.device, dtype)
        self.projection = projection.to(self.device, dtype).eval().requires_grad_(False)
        self.text, self.tokenizer = text_encoder, tokenizer
        self._text_cache: dict[tuple[str, ...], torch.Tensor] = {}

    @property
    def dim(self) -> int:
        return int(self.projection.config["out_dim"])

    @property
    def can_zero_shot(self) -> bool:
        return True

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """Backbone features [B, 1280] of images in [-1, 1] (what the projection is trained on)."""
        if x.ndim != 4 or x.shape[1] not in (1, 3):
            raise ConfigError(f"images must be [B, 3, H, W] in [-1, 1], got shape {tuple(x.shape)}")
        return self.backbone(x.to(self.device, self.dtype))

    def embed(self, x: torch.Tensor, normalize: bool = False) -> torch.Tensor:
        emb = self.projection(self.features(x))
        return F.normalize(emb, dim=-1) if normalize else emb

    @torch.no_grad()
    def embed_text(self, prompts: Sequence[str], normalize: bool = True) -> torch.Tensor:
        key = tuple(prompts)
        if key not in self._text_cache:
            enc = self.tokenizer(list(prompts), padding=True, truncation=True, return_tensors="pt").to(self.device)
            out = self.text(input_ids=enc.input_ids, attention_mask=enc.attention_mask)
            self._text_cache[key] = mean_pool(out.last_hidden_state, enc.attention_mask).to(self.dtype)
        emb = self._text_cache[key]
        return F.normalize(emb, dim=-1) if normalize else emb

    @torch.no_grad()
    def zero_shot(self, x: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        return self.embed(x, normalize=True) @ self.embed_text(prompts).T


def read_projection(folder: Path) -> tuple[Projection, dict]:
    """(the trained projection, its config.json) of an image_encoder/ folder."""
    config = json.loads((folder / "config.json").read_text())
    projection = Projection(config["in_dim"], config["hidden"], config["out_dim"])
    projection.load_state_dict(load_file(folder / "projection.safetensors"))
    return projection, config


def load_embedded_clip(folder: Path, text_encoder, tokenizer, device, dtype) -> EmbeddedClip:
    try:
        projection, config = read_projection(folder)
    except (OSError, KeyError, ValueError, RuntimeError) as err:
        raise ConfigError(f"the embedded image encoder in {folder} cannot be read ({err}); reinstall fedguide or "
                          "rebuild it with `fedguide pretrain-guidance`") from None
    # The projection only fits features of images at the size it was trained at (64 px before it was recorded).
    backbone = ImageBackbone(int(config.get("image_size", IMAGE_SIZE)))
    return EmbeddedClip(projection, text_encoder, tokenizer, backbone=backbone, device=device, dtype=dtype,
                        source=str(folder))
