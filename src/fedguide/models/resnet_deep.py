"""ResNet-18/34 (BasicBlocks) and ResNet-50 (Bottlenecks) for small and ImageNet-size images, d = 512 / 2048.

Also the input-size rule every convnet family here shares (``StemChoice``, ``uses_imagenet_stem``,
``image_shape``).

Decisions:
- Stem: ``stem: auto`` picks the ImageNet stem (7x7 stride-2 conv + 3x3 stride-2 max-pool) when the
  smaller image side is at least 128 pixels, otherwise the CIFAR stem (3x3 stride-1 conv, no
  max-pool), which keeps 32x32 / 28x28 images at full resolution in the first stage; ``cifar`` or
  ``imagenet`` forces one. The threshold sits between the small benchmarks (<= 64) and the 224
  ImageNet crops.
- Bottleneck: the stride sits on the 3x3 conv ("ResNet v1.5", as in the common reference
  implementation); the parameter count is the same as with the stride on the first 1x1 conv.
- The encoder is an ``nn.Sequential`` of stages: the stem's layers, then one ``nn.Sequential`` per
  residual stage, then global average pooling and flatten. models/taps.py therefore sees 5 levels
  (stem and the four stages, as FedRCL taps ResNet-18), each stage's pre-activation level being its
  last block's residual sum before the final ReLU.
- ``width`` scales every stage (64 = the paper); weights keep torch's default initialisation, as
  ``resnet10`` does.
"""
from __future__ import annotations

from typing import Callable, Literal

from pydantic import Field
from torch import nn

from fedguide.models.registry import MODELS, ModelSpec
from fedguide.models.resnet import BasicBlock, shortcut
from fedguide.models.split import BatchNormParams, HeadParams, SplitModel, assemble
from fedguide.registry import ConfigError

StemChoice = Literal["auto", "cifar", "imagenet"]
IMAGENET_MIN_SIDE = 128  # stem: auto uses the ImageNet stem from this smaller image side on
STEM_DESCRIPTION = "auto: ImageNet stem when min(H, W) >= 128, else the small-image stem; cifar|imagenet force one"


def image_shape(spec: ModelSpec, model: str) -> tuple[int, int, int]:
    """(C, H, W) of an image spec; a token-id spec is refused with the model to use instead."""
    if len(spec.input_shape) != 3:
        raise ConfigError(f"model '{model}' takes images (C, H, W), but the data has input shape "
                          f"{tuple(spec.input_shape)} — for token ids use model 'bilstm'")
    c, h, w = spec.input_shape
    return int(c), int(h), int(w)


def uses_imagenet_stem(stem: StemChoice, input_shape: tuple[int, int, int]) -> bool:
    if stem == "auto":
        return min(input_shape[1:]) >= IMAGENET_MIN_SIDE
    return stem == "imagenet"


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (carries the stride), 1x1 expand to 4 x width, plus the shortcut."""

    expansion = 4

    def __init__(self, c_in: int, width: int, stride: int):
        super().__init__()
        c_out = width * self.expansion
        self.conv1 = nn.Conv2d(c_in, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, c_out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(c_out)
        self.relu = nn.ReLU(inplace=True)
        self.shortcut = shortcut(c_in, c_out, stride)

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + self.shortcut(x))


class ResNetDeepParams(HeadParams, BatchNormParams):
    width: int = Field(64, ge=1, description="channels of the first stage; each later stage doubles them")
    stem: StemChoice = Field("auto", description=STEM_DESCRIPTION)


# A block builder takes (c_in, stage width, stride); its output has stage width x expansion channels.
BlockBuilder = Callable[[int, int, int], nn.Module]


def _stem(c_in: int, width: int, imagenet: bool) -> list[nn.Module]:
    if imagenet:
        return [nn.Conv2d(c_in, width, 7, 2, 3, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
                nn.MaxPool2d(3, 2, 1)]
    return [nn.Conv2d(c_in, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True)]


def build_resnet_deep(name: str, block: BlockBuilder, expansion: int, blocks: tuple[int, ...],
                      params: ResNetDeepParams, spec: ModelSpec) -> SplitModel:
    shape = image_shape(spec, name)
    w = params.width
    layers = _stem(shape[0], w, uses_imagenet_stem(params.stem, shape))
    prev = w
    for index, count in enumerate(blocks):
        stage_width = w * 2 ** index
        stage = []
        for i in range(count):
            stage.append(block(prev, stage_width, 2 if (i == 0 and index > 0) else 1))
            prev = stage_width * expansion
        layers.append(nn.Sequential(*stage))
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten()]
    return assemble(nn.Sequential(*layers), prev, spec.num_classes, params)


@MODELS.register("resnet18", params=ResNetDeepParams,
                 summary="ResNet-18 (BasicBlocks 2-2-2-2, CIFAR or ImageNet stem by input size), d=512")
def build_resnet18(params: ResNetDeepParams, spec: ModelSpec) -> SplitModel:
    return build_resnet_deep("resnet18", BasicBlock, 1, (2, 2, 2, 2), params, spec)


@MODELS.register("resnet34", params=ResNetDeepParams,
                 summary="ResNet-34 (BasicBlocks 3-4-6-3, CIFAR or ImageNet stem by input size), d=512")
def build_resnet34(params: ResNetDeepParams, spec: ModelSpec) -> SplitModel:
    return build_resnet_deep("resnet34", BasicBlock, 1, (3, 4, 6, 3), params, spec)


@MODELS.register("resnet50", params=ResNetDeepParams,
                 summary="ResNet-50 (Bottlenecks 3-4-6-3, CIFAR or ImageNet stem by input size), d=2048")
def build_resnet50(params: ResNetDeepParams, spec: ModelSpec) -> SplitModel:
    return build_resnet_deep("resnet50", Bottleneck, Bottleneck.expansion, (3, 4, 6, 3), params, spec)
