"""ShuffleNetV2 (Ma et al. 2018): channel split, two-branch units and channel shuffle; d = 1024 (2048 at x2.0).

Layout as in the paper's Table 5: a 3x3 stride-2 conv to 24 channels and a 3x3 stride-2 max-pool,
stages 2-4 of 4, 8 and 4 units (the first of each downsamples), conv5 (1x1 to 1024, or 2048 at x2.0),
global average pooling; the head is the linear classification layer.

Decisions:
- ``width`` is one of the paper's four sizes 0.5 / 1.0 / 1.5 / 2.0 (stage widths from Table 5).
- A unit's branches: the stride-1 unit splits the channels in half and passes one half through
  unchanged; the stride-2 unit feeds the whole input to both branches (left: depthwise 3x3 + BN,
  1x1 + BN + ReLU; right: 1x1 + BN + ReLU, depthwise 3x3 + BN, 1x1 + BN + ReLU); then the halves
  are concatenated and shuffled with 2 groups.
- Small images (``stem`` as in resnet_deep.py): the stem conv runs at stride 1 and the max-pool is
  left out, exactly as the CIFAR ResNet stem, so a 32x32 image reaches stage 4 at 4x4.
- Encoder levels for models/taps.py: the stem, stages 2-4 (one ``nn.Sequential`` each) and conv5;
  a stage's pre-activation level is the input of its last unit's final ReLU (the right branch).
"""
from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field
from torch import nn

from fedguide.models.registry import MODELS, ModelSpec
from fedguide.models.resnet_deep import STEM_DESCRIPTION, StemChoice, image_shape, uses_imagenet_stem
from fedguide.models.split import BatchNormParams, HeadParams, SplitModel, assemble

STEM_CHANNELS = 24
UNITS_PER_STAGE = (4, 8, 4)
# Table 5: output channels of stages 2, 3, 4 and conv5 per width.
STAGE_CHANNELS = {
    0.5: (48, 96, 192, 1024),
    1.0: (116, 232, 464, 1024),
    1.5: (176, 352, 704, 1024),
    2.0: (244, 488, 976, 2048),
}


def channel_shuffle(x: torch.Tensor, groups: int) -> torch.Tensor:
    n, c, h, w = x.shape
    return x.view(n, groups, c // groups, h, w).transpose(1, 2).reshape(n, c, h, w)


def _depthwise_bn(channels: int, stride: int) -> list[nn.Module]:
    return [nn.Conv2d(channels, channels, 3, stride, 1, groups=channels, bias=False), nn.BatchNorm2d(channels)]


def _pointwise_bn_relu(c_in: int, c_out: int) -> list[nn.Module]:
    return [nn.Conv2d(c_in, c_out, 1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU(inplace=True)]


class ShuffleUnit(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int):
        super().__init__()
        half = c_out // 2
        self.downsamples = stride > 1
        # Without downsampling the left half passes unchanged, so the right branch sees half the input.
        self.left = (nn.Sequential(*_depthwise_bn(c_in, stride), *_pointwise_bn_relu(c_in, half))
                     if self.downsamples else None)
        self.right = nn.Sequential(*_pointwise_bn_relu(c_in if self.downsamples else half, half),
                                   *_depthwise_bn(half, stride), *_pointwise_bn_relu(half, half))

    def forward(self, x):
        if self.left is None:
            left, right = x.chunk(2, dim=1)
        else:
            left, right = self.left(x), x
        return channel_shuffle(torch.cat([left, self.right(right)], dim=1), 2)


class ShuffleNetParams(HeadParams, BatchNormParams):
    width: Literal[0.5, 1.0, 1.5, 2.0] = Field(
        1.0, description="network size: 0.5, 1.0, 1.5 or 2.0 (x1.0 = the paper's main model)")
    stem: StemChoice = Field("auto", description=STEM_DESCRIPTION)


@MODELS.register("shufflenetv2", params=ShuffleNetParams,
                 summary="ShuffleNetV2 x0.5-x2.0 (channel split + shuffle; stem stride by input size), d=1024")
def build_shufflenetv2(params: ShuffleNetParams, spec: ModelSpec) -> SplitModel:
    shape = image_shape(spec, "shufflenetv2")
    imagenet = uses_imagenet_stem(params.stem, shape)
    *stage_channels, conv5 = STAGE_CHANNELS[params.width]
    layers: list[nn.Module] = [nn.Sequential(nn.Conv2d(shape[0], STEM_CHANNELS, 3, 2 if imagenet else 1, 1, bias=False),
                                             nn.BatchNorm2d(STEM_CHANNELS), nn.ReLU(inplace=True))]
    if imagenet:
        layers.append(nn.MaxPool2d(3, 2, 1))
    prev = STEM_CHANNELS
    for channels, units in zip(stage_channels, UNITS_PER_STAGE):
        layers.append(nn.Sequential(*(ShuffleUnit(prev if i == 0 else channels, channels, 2 if i == 0 else 1)
                                      for i in range(units))))
        prev = channels
    layers += [nn.Sequential(*_pointwise_bn_relu(prev, conv5)), nn.AdaptiveAvgPool2d(1), nn.Flatten()]
    return assemble(nn.Sequential(*layers), conv5, spec.num_classes, params)
