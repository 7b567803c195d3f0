"""VGG-16 with BatchNorm (Simonyan & Zisserman 2015, configuration D; BN after every conv).

Thirteen 3x3 convs (with bias, then BatchNorm and ReLU) in five blocks of 64-64 | 128-128 |
256-256-256 | 512-512-512 | 512-512-512 channels, each block closed by a 2x2 max-pool.

Decisions (``stem`` chooses the input-size variant as in resnet_deep.py; auto = ImageNet variant when
min(H, W) >= 128):
- ImageNet variant (224x224): 7x7 adaptive average pooling, flatten, and the two 4096-unit FC layers
  (ReLU, dropout 0.5) stay in the encoder, so z has 4096 dims and encoder + head have the reference
  parameter count; the head is the third FC layer. Needs images of at least 32x32 (five pools).
- Small-image variant (32x32, 28x28): the FC classifier is left out and the fifth max-pool becomes
  global average pooling, so z is the 512-channel map pooled to 512 dims. Pooling the last block
  globally instead of a fifth 2x2 max-pool lets 28x28 images through (they reach the fifth block
  at 1x1); a 32x32 image reaches it at 2x2. Needs images of at least 16x16 (four pools).
- Encoder levels for models/taps.py: the five blocks (one ``nn.Sequential`` each; pre-activation =
  the last conv's BatchNorm output), plus the two FC layers in the ImageNet variant.
"""
from __future__ import annotations

from pydantic import Field
from torch import nn

from fedguide.models.registry import MODELS, ModelSpec
from fedguide.models.resnet_deep import STEM_DESCRIPTION, StemChoice, image_shape, uses_imagenet_stem
from fedguide.models.split import BatchNormParams, HeadParams, SplitModel, assemble
from fedguide.registry import ConfigError

VGG16_BLOCKS = ((64, 64), (128, 128), (256, 256, 256), (512, 512, 512), (512, 512, 512))
FC_WIDTH = 4096
POOLED_SIDE = 7  # the ImageNet variant pools the last map to 7x7 before the FC layers


class VGGParams(HeadParams, BatchNormParams):
    stem: StemChoice = Field("auto", description=STEM_DESCRIPTION)
    dropout: float = Field(0.5, ge=0, lt=1, description="dropout after each 4096 FC layer (ImageNet variant)")


def _block(c_in: int, widths: tuple[int, ...], pool: nn.Module) -> nn.Sequential:
    layers: list[nn.Module] = []
    for width in widths:
        layers += [nn.Conv2d(c_in, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(inplace=True)]
        c_in = width
    return nn.Sequential(*layers, pool)


@MODELS.register("vgg16_bn", params=VGGParams,
                 summary="VGG-16 with BatchNorm; 224: the two 4096 FC layers in the encoder (d=4096), small: d=512")
def build_vgg16_bn(params: VGGParams, spec: ModelSpec) -> SplitModel:
    shape = image_shape(spec, "vgg16_bn")
    imagenet = uses_imagenet_stem(params.stem, shape)
    max_pools = len(VGG16_BLOCKS) if imagenet else len(VGG16_BLOCKS) - 1
    if min(shape[1:]) < 2 ** max_pools:
        variant = "ImageNet" if imagenet else "small-image"
        fix = "use stem: cifar or auto" if imagenet and min(shape[1:]) >= 2 ** (max_pools - 1) else "use another model"
        raise ConfigError(f"model 'vgg16_bn' ({variant} variant) needs images of at least {2 ** max_pools}x"
                          f"{2 ** max_pools}; got {shape[1]}x{shape[2]} — {fix}")
    layers: list[nn.Module] = []
    c_in = shape[0]
    for index, widths in enumerate(VGG16_BLOCKS):
        last = index == len(VGG16_BLOCKS) - 1
        pool = nn.AdaptiveAvgPool2d(1) if (last and not imagenet) else nn.MaxPool2d(2)
        layers.append(_block(c_in, widths, pool))
        c_in = widths[-1]
    if not imagenet:
        layers.append(nn.Flatten())
        return assemble(nn.Sequential(*layers), c_in, spec.num_classes, params)
    layers += [nn.AdaptiveAvgPool2d(POOLED_SIDE), nn.Flatten(),
               nn.Linear(c_in * POOLED_SIDE ** 2, FC_WIDTH), nn.ReLU(inplace=True), nn.Dropout(params.dropout),
               nn.Linear(FC_WIDTH, FC_WIDTH), nn.ReLU(inplace=True), nn.Dropout(params.dropout)]
    return assemble(nn.Sequential(*layers), FC_WIDTH, spec.num_classes, params)
