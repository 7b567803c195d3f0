"""ResNet-10 as used by MOON/FedDifRC: BasicBlocks [1, 1, 1, 1], widths 64-128-256-512, d = 512."""
from __future__ import annotations

from pydantic import Field
from torch import nn

from fedguide.models.registry import MODELS, ModelSpec
from fedguide.models.split import BatchNormParams, HeadParams, SplitModel, assemble


def shortcut(c_in: int, c_out: int, stride: int) -> nn.Module:
    """Identity, or a strided 1x1 projection where the block changes shape."""
    if stride == 1 and c_in == c_out:
        return nn.Sequential()
    return nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))


class BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.relu = nn.ReLU(inplace=True)
        self.shortcut = shortcut(c_in, c_out, stride)

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


class ResNetParams(HeadParams, BatchNormParams):
    blocks: tuple[int, int, int, int] = (1, 1, 1, 1)
    width: int = Field(64, ge=1)


@MODELS.register("resnet10", params=ResNetParams, summary="ResNet-10 (CIFAR stem, BasicBlocks 1-1-1-1), d=512")
def build_resnet(params: ResNetParams, spec: ModelSpec) -> SplitModel:
    c_in = spec.input_shape[0]
    w = params.width
    widths = [w, 2 * w, 4 * w, 8 * w]
    # The CIFAR stem (3x3 conv, no max-pool) keeps small images at full resolution in the first stage.
    layers: list[nn.Module] = [nn.Conv2d(c_in, w, 3, 1, 1, bias=False), nn.BatchNorm2d(w), nn.ReLU(inplace=True)]
    prev = w
    for stage, (width, n) in enumerate(zip(widths, params.blocks)):
        for i in range(n):
            layers.append(BasicBlock(prev, width, 2 if (i == 0 and stage > 0) else 1))
            prev = width
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten()]
    return assemble(nn.Sequential(*layers), prev, spec.num_classes, params)
