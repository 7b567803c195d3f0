"""Self-supervised ViT image encoders (MAE, DINO, DINOv2) as frozen embedders: FedDifRC Table 8's
MAE-ViT-B/16 and DINO-ViT-B/16 rows.

``load_vit_encoder`` takes a hub id or folder of a transformers ``ViTMAEModel`` (or a ``ViTMAEForPreTraining``
checkpoint such as facebook/vit-mae-base: its encoder is read, the decoder left), a ``ViTModel`` (DINO:
facebook/dino-vitb16) or a ``Dinov2Model`` (facebook/dinov2-base). Offline, a hub id that is not in the local
cache is refused at once with the command that downloads it (``sources.resolve_source``).

The embedding of an image is the last layer's (layer-normalised) class token (``pooling: cls``, what DINO's
and MAE's linear probes read) or the mean of its patch tokens (``mean``). Images arrive in [-1, 1], are
resized to the checkpoint's ``image_size`` (bicubic) and standardised with its preprocessor statistics
(ImageNet's when it ships none), in torch, on the device. MAE's encoder masks 75 % of the patches during
pre-training: here its mask ratio is 0 and its patch order the identity (a fixed ``noise``), so the
embedding sees the whole image and draws nothing from torch's random streams.
"""
from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch

from fedguide.guidance.image_encoder import encoder_pixels, preprocessor_stats
from fedguide.guidance.sources import MODEL_FILES, GuidanceLoadError, fingerprint, resolve_source

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
Pooling = Literal["cls", "mean"]


class ViTImageEncoder:
    def __init__(self, model, kind: str, mean, std, source: str, model_id: str, pooling: Pooling = "cls",
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
        self.device, self.dtype, self.kind, self.source, self.model_id = torch.device(device), dtype, kind, source, model_id
        self.pooling = pooling
        self.model = model.to(self.device, dtype).eval().requires_grad_(False)
        self.mean = torch.tensor(mean, device=self.device, dtype=dtype).view(1, 3, 1, 1)
        self.std = torch.tensor(std, device=self.device, dtype=dtype).view(1, 3, 1, 1)
        self.size = int(model.config.image_size)

    @property
    def dim(self) -> int:
        return int(self.model.config.hidden_size)

    def preprocess(self, x: torch.Tensor) -> torch.Tensor:
        return encoder_pixels(x, self.size, self.mean, self.std)

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """[B, hidden_size]: the class token or the mean patch token of the last layer."""
        pixels = self.preprocess(x)
        if self.kind == "vit_mae":
            patches = (self.size // int(self.model.config.patch_size)) ** 2
            noise = torch.arange(patches, device=self.device, dtype=torch.float32).expand(len(pixels), -1)
            hidden = self.model(pixel_values=pixels, noise=noise).last_hidden_state
        else:
            hidden = self.model(pixel_values=pixels).last_hidden_state
        return hidden[:, 0] if self.pooling == "cls" else hidden[:, 1:].mean(dim=1)


def _stats(folder: Path) -> tuple[tuple[float, ...], tuple[float, ...]]:
    return preprocessor_stats([folder / "preprocessor_config.json"], IMAGENET_MEAN, IMAGENET_STD)


def load_vit_encoder(source: str, revision: str | None, device: torch.device, dtype: torch.dtype,
                     pooling: Pooling = "cls", setting: str = "method.encoder") -> ViTImageEncoder:
    from transformers import AutoConfig, Dinov2Model, ViTMAEModel, ViTModel

    folder = resolve_source(source, revision, allow=MODEL_FILES, setting=setting)
    try:
        config = AutoConfig.from_pretrained(folder)
        kind = config.model_type
        if kind == "vit_mae":
            model = ViTMAEModel.from_pretrained(folder, dtype=dtype, mask_ratio=0.0)
        elif kind == "vit":
            model = ViTModel.from_pretrained(folder, dtype=dtype, add_pooling_layer=False)
        elif kind == "dinov2":
            model = Dinov2Model.from_pretrained(folder, dtype=dtype)
        else:
            raise GuidanceLoadError(f"{setting}: '{source}' is a {kind} model; pass a ViTMAE (e.g. facebook/vit-mae-base), "
                                    "ViT (DINO, e.g. facebook/dino-vitb16) or Dinov2 (facebook/dinov2-base) model")
    except (OSError, ValueError) as err:
        raise GuidanceLoadError(f"{setting}: '{source}' ({folder}) cannot be read as a ViT model: {err}; pass a ViTMAE, "
                                "ViT (DINO) or Dinov2 folder or hub id") from None
    mean, std = _stats(folder)
    return ViTImageEncoder(model, kind, mean, std, source, fingerprint(folder, source), pooling, device, dtype)
