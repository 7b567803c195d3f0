"""Training-time augmentation (``train.augment``), batched on the run's device.

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

How it runs, so that a training step on a GPU never waits for the host:
- ``crop`` and ``crop_flip`` are written here as batched tensor operations: one ``torch.randint`` on the
  batch's device draws every image's offsets (and flip), and one ``torch.gather`` of the zero-padded batch
  with index grids built from them takes all the crops (a flip reverses the column index, chosen per
  image with ``torch.where``). No Python loop over images, no value read back on the host; the number of
  operations does not depend on the batch size. The result is exactly "pad 4 px with zeros, cut the
  image at offset (dy, dx), mirror it if drawn" (a gather copies pixels, it computes nothing).
- ``autoaugment`` runs kornia's ``AutoAugment('imagenet')`` (the policy's implementation) after that
  crop and flip. What kornia does, as read in its code and counted with the simulated device: its
  operations are batched (per sub-policy the operation count does not grow with the batch, e.g.
  equalize builds every image's histogram in one scatter), and it reads nothing back from the device
  (no host sync). But it draws on the host: one sub-policy per call, the same for the whole batch (a
  ``Categorical`` over a host tensor, picked in Python), and each operation's per-image gates and
  magnitudes from the host's default generator, which it then copies to the device (a few hundred
  bytes per batch). Moving its generators to the device (``.to(device)``) is worse: its samplers then
  read device values on the host, about ten syncs a batch, so they stay on the host. (kornia's own
  ``RandomCrop``, used here before, also drew on the host and cut the images one by one in Python.)
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from fedguide.config import AUGMENTATIONS
from fedguide.registry import ConfigError

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


def draw_crops(batch: int, device: torch.device,
               flip: bool) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Each image's crop offsets (dy, dx), each in [0, 2 * PADDING], and whether it is mirrored (None
    without flips): one ``torch.randint`` on ``device`` from its default generator, so a seed fixes them."""
    span = 2 * PADDING + 1
    code = torch.randint(0, span * span * (2 if flip else 1), (batch,), device=device)
    dy, dx = code % span, (code // span) % span
    return dy, dx, (code >= span * span) if flip else None


def crop_at(x: torch.Tensor, dy: torch.Tensor, dx: torch.Tensor, flip: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Batch ``x`` [B, C, H, W] zero-padded by PADDING on every side, each image cut back to H x W at row
    ``dy[b]`` and column ``dx[b]`` of the padded image, then mirrored left-right where ``flip[b]``: one
    gather with per-image index grids, no loop over images."""
    b, c, h, w = x.shape
    padded = F.pad(x, (PADDING, PADDING, PADDING, PADDING))
    wide = w + 2 * PADDING
    rows = torch.arange(h, device=x.device)
    cols = torch.arange(w, device=x.device)
    rows = dy.view(b, 1) + rows  # [B, H]
    cols = cols.expand(b, w) if flip is None else torch.where(flip.view(b, 1), (w - 1) - cols, cols)
    cols = dx.view(b, 1) + cols  # [B, W]
    flat = (rows.view(b, h, 1) * wide + cols.view(b, 1, w)).view(b, 1, h * w).expand(b, c, h * w)
    return padded.reshape(b, c, -1).gather(2, flat).view(b, c, h, w)


def random_crop(x: torch.Tensor, flip: bool) -> torch.Tensor:
    """``crop`` (and ``crop_flip`` with ``flip``) of a batch, every draw on its device."""
    dy, dx, mirrored = draw_crops(x.shape[0], x.device, flip)
    return crop_at(x, dy, dx, mirrored)


def build_augment(name: str, input_shape: tuple[int, ...]) -> Optional[Augment]:
    """The recipe as a function of a batch of [0, 1] images, or None for ``none``."""
    if name == "none":
        return None
    flip = name in ("crop_flip", "autoaugment")
    policy = None
    if name == "autoaugment":
        from kornia.augmentation.auto import AutoAugment

        policy = AutoAugment("imagenet")

    def augment(unit: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            out = random_crop(unit, flip).clamp_(0.0, 1.0)
            if policy is not None:
                out = policy(out).clamp_(0.0, 1.0)
            return out

    return augment
