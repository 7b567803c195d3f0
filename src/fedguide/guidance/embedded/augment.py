"""Random views of small images, for training models that must not care about a digit's colour or pose.

digits_domains keeps its domains' colour and polarity on purpose (light-on-dark handwriting, dark-on-light
or coloured font renders, digits over photo crops), and its public slice has ~14 images per class and
domain. A model fitted to those few learns the colours: the frozen EfficientNet features of an inverted
or recoloured digit lie far from the original's, and the mini-CLIP projection trained on the slice alone
named the right class for 59 % of the test images; with 31 views of each digit it names 68 %.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def random_views(x: torch.Tensor, gen: torch.Generator, affine: bool = True, colour: bool = True,
                 max_degrees: float = 15.0, max_scale: float = 0.15, max_shift: float = 0.0625,
                 p_invert: float = 0.3, p_grey: float = 0.2) -> torch.Tensor:
    """One random view of each image of ``x`` ([B, 3, H, W] in [-1, 1]); a pure function of ``gen``'s state.

    affine: rotation within ±max_degrees, zoom within 1 ± max_scale, shift within ±max_shift of the side;
    the uncovered border takes the image's top-left pixel (the background in every embedded dataset).
    colour: a random permutation of the channels, then negation with ``p_invert`` and the channel mean
    with ``p_grey``.
    """
    if x.ndim != 4 or x.shape[1] != 3:
        raise ValueError(f"random_views needs RGB images [B, 3, H, W], got shape {tuple(x.shape)}")
    b = len(x)
    if affine:
        angle = (torch.rand(b, generator=gen) * 2 - 1) * math.radians(max_degrees)
        scale = 1 + (torch.rand(b, generator=gen) * 2 - 1) * max_scale
        shift = (torch.rand(b, 2, generator=gen) * 2 - 1) * max_shift * 2  # affine_grid's side is 2 units
        cos, sin = torch.cos(angle) / scale, torch.sin(angle) / scale
        theta = torch.stack([torch.stack([cos, -sin, shift[:, 0]], 1), torch.stack([sin, cos, shift[:, 1]], 1)], 1)
        grid = F.affine_grid(theta, list(x.shape), align_corners=False)
        background = x[:, :, :1, :1]
        x = F.grid_sample(x - background, grid, align_corners=False, padding_mode="zeros") + background
    if colour:
        order = torch.stack([torch.randperm(3, generator=gen) for _ in range(b)])
        x = torch.gather(x, 1, order[:, :, None, None].expand_as(x))
        invert = torch.rand(b, generator=gen) < p_invert
        x = torch.where(invert[:, None, None, None], -x, x)
        grey = torch.rand(b, generator=gen) < p_grey
        x = torch.where(grey[:, None, None, None], x.mean(1, keepdim=True).expand_as(x), x)
    return x
