"""Training-time augmentation (``train.augment``), batched on the run's device with kornia.

Each recipe works on images in [0, 1] (the pixels the source standardised), so padding is black and
AutoAugment's colour operations see real pixel values, as the papers' torchvision pipelines do on PIL
images; the batch is standardised again afterwards. Random draws come from the global generator, which
``fl.client_step`` seeds from (seed, round, client) before a client trains: two runs with one seed
augment alike, a resumed run repeats the uninterrupted one, and the worker count changes nothing.

Recipes (what the papers and their released code use; each paper config names its own):
- ``none``: no augmentation.
- ``crop``: random crop back to the image size after 4 px zero padding (digits: no flips, which change a
  digit's meaning).
- ``crop_flip``: ``crop`` + horizontal flip with p = 0.5, the standard CIFAR recipe of the released
  CIFAR code the diffusion-guided papers build on.
- ``autoaugment``: ``crop_flip`` followed by AutoAugment's ImageNet policy (Cubuk et al., CVPR 2019),
  FedDifRC's TinyImageNet recipe (its Sec. 4.1 cites [5]); three-channel images only.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from fedguide.registry import ConfigError

AUGMENTATIONS = ("none", "crop", "crop_flip", "autoaugment")
PADDING = 4

Augment = Callable[[torch.Tensor], torch.Tensor]


def check_augment(name: str, input_shape: tuple[int, ...], floating: bool, has_pixel_stats: bool) -> None:
    """A sentence for a recipe these inputs cannot take, before anything runs."""
    if name not in AUGMENTATIONS:
        raise ConfigError(f"train.augment: {name!r} is not a recipe; choose one of {', '.join(AUGMENTATIONS)}")
    if name == "none":
        return
    if not floating or len(input_shape) != 3:
        raise ConfigError(f"train.augment: {name} augments images, but this data set's inputs are "
                          f"{'token ids' if not floating else f'of shape {input_shape}'}; write train.augment: none")
    if not has_pixel_stats:
        raise ConfigError(f"train.augment: {name} works on the source's pixels, but this data set does not declare "
                          "the statistics it standardised with (DatasetSplits.pixel_stats); write train.augment: none")
    if name == "autoaugment" and input_shape[0] != 3:
        raise ConfigError(f"train.augment: autoaugment needs three-channel images (its colour operations), these "
                          f"have {input_shape[0]}; write crop or crop_flip")


def build_augment(name: str, input_shape: tuple[int, ...]) -> Optional[Augment]:
    """The recipe as a function of a batch of [0, 1] images, or None for ``none``."""
    if name == "none":
        return None
    import kornia.augmentation as K

    size = tuple(input_shape[1:])
    steps = [K.RandomCrop(size, padding=PADDING, fill=0.0)]
    if name in ("crop_flip", "autoaugment"):
        steps.append(K.RandomHorizontalFlip(p=0.5))
    if name == "autoaugment":
        from kornia.augmentation.auto import AutoAugment

        steps.append(AutoAugment("imagenet"))
    pipeline = K.AugmentationSequential(*steps)

    def augment(unit: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return pipeline(unit).clamp_(0.0, 1.0)

    return augment
