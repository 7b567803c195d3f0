"""MobileNetV2 (Sandler et al. 2018) and MobileNetV3-Small (Howard et al. 2019): inverted residual blocks.

MobileNetV2: a 3x3 stride-2 stem conv to 32 channels, the seven inverted-residual stages of the
paper's Table 2, a 1x1 conv to 1280, global average pooling and dropout 0.2; z = 1280 (at width <= 1).
MobileNetV3-Small: a 3x3 stride-2 stem conv to 16 channels (hardswish), the eleven bnecks of Table 2
(squeeze-excite and ReLU/hardswish per block), a 1x1 conv to 576 (hardswish), global average pooling,
a 1024-unit linear layer with hardswish and dropout 0.2; z = 1024. The head is the linear
classification layer in both.

Decisions where the papers leave room:
- ``width`` multiplies every channel count, rounded to a multiple of 8 and never more than 10 % below
  the scaled value (the rule of the papers' released code). MobileNetV2 keeps its last conv at 1280
  for widths below 1 (paper, Sec. 6.1); MobileNetV3-Small scales its 576 and 1024 layers too.
- MobileNetV3-Small has no squeeze-excite on its last 1x1 conv (the paper's table marks one; the
  common reference implementation, whose parameter count the tests pin, has none) and a linear
  layer where the paper writes a 1x1 conv without BatchNorm on the pooled map (the same weights).
  Squeeze-excite: global average pool, 1x1 conv to make_divisible(expanded / 4), ReLU, 1x1 conv
  back, hard-sigmoid gate.
- Small images (``stem`` as in resnet_deep.py): the stem conv and the first stride-2 block run
  at stride 1, which removes the same factor 4 the CIFAR ResNet stem removes (no stride-2 conv,
  no max-pool): a 32x32 image reaches the last stage at 4x4 instead of 1x1.
- Dropout 0.2 belongs to the reference classifier; here it is the encoder's last layer
  (``dropout`` sets it, 0 removes it), so z is the dropped-out feature in training mode.
- Encoder levels for models/taps.py: the stem, one ``nn.Sequential`` per stage (V2: the rows of
  Table 2; V3-Small: consecutive blocks with the same output width), the last conv, and for
  V3-Small the 1024 linear layer. A linear-bottleneck block ends without an activation, so its
  representation is its output: blocks apply their activations as functions, not modules, so that
  a pre-activation tap takes the stage's output rather than an expanded map inside its last block.
- BatchNorm keeps torch's defaults, and weights torch's default initialisation.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from fedguide.models.registry import MODELS, ModelSpec
from fedguide.models.resnet_deep import STEM_DESCRIPTION, StemChoice, image_shape, uses_imagenet_stem
from fedguide.models.split import BatchNormParams, HeadParams, SplitModel, assemble

Activation = Callable[[torch.Tensor], torch.Tensor]

# MobileNetV2, Table 2: (expansion t, output channels c, blocks n, first block's stride s).
V2_STAGES = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1))
V2_STEM, V2_LAST = 32, 1280

# MobileNetV3-Small, Table 2: (kernel, expanded channels, output channels, squeeze-excite, activation, stride).
V3_SMALL_BLOCKS = (
    (3, 16, 16, True, "relu", 2),
    (3, 72, 24, False, "relu", 2),
    (3, 88, 24, False, "relu", 1),
    (5, 96, 40, True, "hardswish", 2),
    (5, 240, 40, True, "hardswish", 1),
    (5, 240, 40, True, "hardswish", 1),
    (5, 120, 48, True, "hardswish", 1),
    (5, 144, 48, True, "hardswish", 1),
    (5, 288, 96, True, "hardswish", 2),
    (5, 576, 96, True, "hardswish", 1),
    (5, 576, 96, True, "hardswish", 1),
)
V3_SMALL_STEM, V3_SMALL_LAST_CONV_RATIO, V3_SMALL_LAST = 16, 6, 1024
ACTIVATIONS: dict[str, Activation] = {"relu": F.relu, "relu6": F.relu6, "hardswish": F.hardswish}


def make_divisible(value: float, divisor: int = 8) -> int:
    """``value`` rounded to the nearest multiple of ``divisor``, moved up one step if that lost over 10 %."""
    rounded = max(divisor, int(value + divisor / 2) // divisor * divisor)
    return rounded + divisor if rounded < 0.9 * value else rounded


def conv_bn(c_in: int, c_out: int, kernel: int, stride: int = 1, groups: int = 1) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(c_in, c_out, kernel, stride, (kernel - 1) // 2, groups=groups, bias=False),
                         nn.BatchNorm2d(c_out))


class SqueezeExcite(nn.Module):
    def __init__(self, channels: int, squeeze: int):
        super().__init__()
        self.reduce = nn.Conv2d(channels, squeeze, 1)
        self.expand = nn.Conv2d(squeeze, channels, 1)

    def forward(self, x):
        gate = F.hardsigmoid(self.expand(F.relu(self.reduce(F.adaptive_avg_pool2d(x, 1)))))
        return x * gate


class InvertedResidual(nn.Module):
    """1x1 expand (left out when it would not widen), depthwise conv, optional squeeze-excite, linear 1x1 project."""

    def __init__(self, c_in: int, hidden: int, c_out: int, kernel: int, stride: int, activation: str,
                 squeeze_excite: bool = False):
        super().__init__()
        self.expand = conv_bn(c_in, hidden, 1) if hidden != c_in else None
        self.depthwise = conv_bn(hidden, hidden, kernel, stride, groups=hidden)
        self.excite = SqueezeExcite(hidden, make_divisible(hidden // 4)) if squeeze_excite else None
        self.project = conv_bn(hidden, c_out, 1)
        self.activation = ACTIVATIONS[activation]
        self.residual = stride == 1 and c_in == c_out

    def forward(self, x):
        out = x if self.expand is None else self.activation(self.expand(x))
        out = self.activation(self.depthwise(out))
        if self.excite is not None:
            out = self.excite(out)
        out = self.project(out)
        return x + out if self.residual else out


def conv_bn_act(c_in: int, c_out: int, kernel: int, stride: int, activation: nn.Module) -> nn.Sequential:
    return nn.Sequential(*conv_bn(c_in, c_out, kernel, stride), activation)


class MobileNetParams(HeadParams, BatchNormParams):
    width: float = Field(1.0, gt=0, description="width multiplier of every channel count")
    stem: StemChoice = Field("auto", description=STEM_DESCRIPTION)
    dropout: float = Field(0.2, ge=0, lt=1, description="dropout on z (the reference classifier's)")


def _stride(stride: int, first_downsampling: bool, small: bool) -> int:
    # Small images skip the stem's and the first stride-2 block's downsampling (see the docstring).
    return 1 if (small and first_downsampling) else stride


@MODELS.register("mobilenetv2", params=MobileNetParams,
                 summary="MobileNetV2 (inverted residuals, width multiplier; stem stride by input size), d=1280")
def build_mobilenetv2(params: MobileNetParams, spec: ModelSpec) -> SplitModel:
    shape = image_shape(spec, "mobilenetv2")
    small = not uses_imagenet_stem(params.stem, shape)
    prev = make_divisible(V2_STEM * params.width)
    layers: list[nn.Module] = [conv_bn_act(shape[0], prev, 3, _stride(2, True, small), nn.ReLU6(inplace=True))]
    first_downsampling = True
    for expansion, channels, count, stride in V2_STAGES:
        c_out = make_divisible(channels * params.width)
        blocks = []
        for i in range(count):
            s = stride if i == 0 else 1
            if s == 2:
                s, first_downsampling = _stride(s, first_downsampling, small), False
            blocks.append(InvertedResidual(prev, int(round(prev * expansion)), c_out, 3, s, "relu6"))
            prev = c_out
        layers.append(nn.Sequential(*blocks))
    last = make_divisible(V2_LAST * max(1.0, params.width))
    layers += [conv_bn_act(prev, last, 1, 1, nn.ReLU6(inplace=True)), nn.AdaptiveAvgPool2d(1), nn.Flatten()]
    if params.dropout > 0:
        layers.append(nn.Dropout(params.dropout))
    return assemble(nn.Sequential(*layers), last, spec.num_classes, params)


@MODELS.register("mobilenetv3_small", params=MobileNetParams,
                 summary="MobileNetV3-Small (squeeze-excite, hardswish; stem stride by input size), d=1024")
def build_mobilenetv3_small(params: MobileNetParams, spec: ModelSpec) -> SplitModel:
    shape = image_shape(spec, "mobilenetv3_small")
    small = not uses_imagenet_stem(params.stem, shape)
    prev = make_divisible(V3_SMALL_STEM * params.width)
    layers: list[nn.Module] = [conv_bn_act(shape[0], prev, 3, _stride(2, True, small), nn.Hardswish())]
    stages: list[list[nn.Module]] = []
    first_downsampling, stage_width = True, None
    for kernel, expanded, channels, squeeze_excite, activation, stride in V3_SMALL_BLOCKS:
        c_out = make_divisible(channels * params.width)
        if stride == 2:
            stride, first_downsampling = _stride(stride, first_downsampling, small), False
        if channels != stage_width:  # the table's widths: scaled ones can coincide
            stages.append([])
            stage_width = channels
        stages[-1].append(InvertedResidual(prev, make_divisible(expanded * params.width), c_out, kernel, stride,
                                           activation, squeeze_excite))
        prev = c_out
    layers += [nn.Sequential(*blocks) for blocks in stages]
    last_conv = V3_SMALL_LAST_CONV_RATIO * prev
    last = make_divisible(V3_SMALL_LAST * params.width)
    layers += [conv_bn_act(prev, last_conv, 1, 1, nn.Hardswish()), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
               nn.Linear(last_conv, last), nn.Hardswish()]
    if params.dropout > 0:
        layers.append(nn.Dropout(params.dropout))
    return assemble(nn.Sequential(*layers), last, spec.num_classes, params)
