"""Strong image augmentation for the semi-supervised baselines (SemiFL, RSCFed), in plain torch.

FixMatch-style consistency needs a weak and a strong view of each unlabeled image. With a frozen image
encoder the views enter only through their features, so each client encodes a small bank of strongly
augmented copies of its images once (``FrozenFeatures.augmented_views``) and every training step draws
one copy per sample. The weak view is the image itself (its features are cached anyway): FixMatch's weak
flip-and-shift is left out because horizontal flips change digits.

``strong_augment`` (images in [-1, 1], [B, C, H, W]; every random draw from the given generator, one set
per image): a shift of up to 1/8 of the side in each direction (reflect padding, then a crop), contrast
×U(0.6, 1.4) about the image mean, brightness +U(−0.3, 0.3), Gaussian noise of std 0.05, and a cutout
of a square of side H/4 set to the image mean (RandAugment's colour and geometry operations plus
Cutout, reduced to what torch does without torchvision).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _uniform(n: int, low: float, high: float, gen: torch.Generator) -> torch.Tensor:
    return low + (high - low) * torch.rand(n, generator=gen)


def strong_augment(images: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    x = images.float()
    b, _, h, w = x.shape
    pad_h, pad_w = max(1, h // 8), max(1, w // 8)
    padded = F.pad(x, (pad_w, pad_w, pad_h, pad_h), mode="reflect")
    dy = torch.randint(0, 2 * pad_h + 1, (b,), generator=gen)
    dx = torch.randint(0, 2 * pad_w + 1, (b,), generator=gen)
    rows = (dy[:, None] + torch.arange(h)[None])  # [B, H]
    cols = (dx[:, None] + torch.arange(w)[None])  # [B, W]
    batch = torch.arange(b)[:, None, None]
    x = padded.permute(0, 2, 3, 1)[batch, rows[:, :, None], cols[:, None, :]].permute(0, 3, 1, 2)
    mean = x.mean(dim=(1, 2, 3), keepdim=True)
    x = (x - mean) * _uniform(b, 0.6, 1.4, gen).view(b, 1, 1, 1) + mean
    x = x + _uniform(b, -0.3, 0.3, gen).view(b, 1, 1, 1)
    x = x + 0.05 * torch.randn(x.shape, generator=gen)
    side_h, side_w = max(1, h // 4), max(1, w // 4)
    top = torch.randint(0, h - side_h + 1, (b,), generator=gen)
    left = torch.randint(0, w - side_w + 1, (b,), generator=gen)
    ys, xs = torch.arange(h)[None, :, None], torch.arange(w)[None, None, :]
    box = ((ys >= top[:, None, None]) & (ys < (top + side_h)[:, None, None])
           & (xs >= left[:, None, None]) & (xs < (left + side_w)[:, None, None]))
    x = torch.where(box[:, None], mean.expand_as(x), x)
    return x.clamp(-1, 1)
