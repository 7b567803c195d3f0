"""The small CNN for 28x28 / 32x32 grey or colour images (about 0.58 M parameters on Fashion-MNIST).

Two 5x5 convolutions without padding, each with ReLU and (``pooling``) 2x2 max-pooling, then (``feature_dim``)
one FC layer with ReLU; z is its output, or the flattened feature maps without it. ``pooling: false,
feature_dim: null`` is FedDW's MNIST feature extractor (Sec. V-A: "a simple two-layer CNN ... For CIFAR-10,
we add two max pooling layers after the CNN layers"; the FC layers are its mapping layers,
``mapping: [128, 128]``). The paper gives no widths or kernel sizes; its released code's MNIST CNN
(models.py, CNN_mnist) has 5x5 kernels and 10 and 20 channels, and pools (the paper's text does not).

``batch_norm: true`` puts a BatchNorm after each convolution and after the FC layer, before its ReLU, as
FedBN's digit model does (med-air/FedBN, nets/models.py, DigitModel: conv -> bn -> relu -> pool, fc -> bn ->
relu): the layers FedBN keeps on each client.
"""
from __future__ import annotations

from typing import Optional

from pydantic import Field
from torch import nn

from fedguide.models.registry import MODELS, ModelSpec
from fedguide.models.split import HeadParams, SplitModel, assemble


class CNNParams(HeadParams):
    feature_dim: Optional[int] = Field(512, ge=1, description="width of the FC layer closing the encoder; null = "
                                                              "none (z = the flattened feature maps)")
    channels: tuple[int, int] = (32, 64)
    pooling: bool = Field(True, description="2x2 max-pooling after each convolution (false: FedDW's MNIST CNN)")
    batch_norm: bool = Field(False, description="BatchNorm after each convolution and the FC layer (FedBN's digit "
                                                "model); what method.name=fedbn keeps local")


@MODELS.register("cnn", params=CNNParams, summary="2 conv (+ 2 max-pool) + FC encoder (d=512), linear head")
def build_cnn(params: CNNParams, spec: ModelSpec) -> SplitModel:
    c_in, h, w = spec.input_shape
    c1, c2 = params.channels

    def after(s: int) -> int:  # a 5x5 convolution without padding, then the optional 2x2 pooling
        return (s - 4) // 2 if params.pooling else s - 4

    out_h, out_w = after(after(h)), after(after(w))
    if out_h < 1 or out_w < 1:
        least = 12 if params.pooling else 9
        raise ValueError(f"model 'cnn' needs images of at least {least}x{least}; got {h}x{w} — use another model")
    def pool() -> list[nn.Module]:
        return [nn.MaxPool2d(2)] if params.pooling else []

    def norm(kind: type, width: int) -> list[nn.Module]:
        return [kind(width)] if params.batch_norm else []

    layers = [nn.Conv2d(c_in, c1, 5), *norm(nn.BatchNorm2d, c1), nn.ReLU(inplace=True), *pool(),
              nn.Conv2d(c1, c2, 5), *norm(nn.BatchNorm2d, c2), nn.ReLU(inplace=True), *pool(), nn.Flatten()]
    feature_dim = c2 * out_h * out_w
    if params.feature_dim is not None:
        layers += [nn.Linear(feature_dim, params.feature_dim), *norm(nn.BatchNorm1d, params.feature_dim),
                   nn.ReLU(inplace=True)]
        feature_dim = params.feature_dim
    return assemble(nn.Sequential(*layers), feature_dim, spec.num_classes, params)
