"""The small CNN for 28x28 / 32x32 grey or colour images (about 0.58 M parameters on Fashion-MNIST)."""
from __future__ import annotations

from pydantic import Field
from torch import nn

from fedguide.models.registry import MODELS, ModelSpec
from fedguide.models.split import HeadParams, SplitModel, assemble


class CNNParams(HeadParams):
    feature_dim: int = Field(512, ge=1)
    channels: tuple[int, int] = (32, 64)


@MODELS.register("cnn", params=CNNParams, summary="2 conv + 2 max-pool + FC encoder (d=512), linear head")
def build_cnn(params: CNNParams, spec: ModelSpec) -> SplitModel:
    c_in, h, w = spec.input_shape
    c1, c2 = params.channels
    # Two 5x5 'same'-less convs each followed by 2x2 pooling: spatial size (s - 4) // 2, twice.
    out_h, out_w = ((h - 4) // 2 - 4) // 2, ((w - 4) // 2 - 4) // 2
    if out_h < 1 or out_w < 1:
        raise ValueError(f"model 'cnn' needs images of at least 12x12; got {h}x{w} — use another model")
    encoder = nn.Sequential(
        nn.Conv2d(c_in, c1, 5), nn.ReLU(inplace=True), nn.MaxPool2d(2),
        nn.Conv2d(c1, c2, 5), nn.ReLU(inplace=True), nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(c2 * out_h * out_w, params.feature_dim), nn.ReLU(inplace=True),
    )
    return assemble(encoder, params.feature_dim, spec.num_classes, params)
