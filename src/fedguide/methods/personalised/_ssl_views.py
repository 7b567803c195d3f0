"""Two random views of a batch for the self-supervised baselines (FedEMA's BYOL), on the batch's device.

The SimCLR/BYOL recipe the released FedSSL code uses (RandomResizedCrop, horizontal flip, colour jitter
with p = 0.8, grayscale with p = 0.2), reduced to batched torch operations on the standardised inputs the
local loop hands over:
- random resized crop: a box of U(0.2, 1) of the area and aspect ratio in [3/4, 4/3] (log-uniform),
  resampled to the input size (bilinear, one ``affine_grid``/``grid_sample`` for the whole batch);
- horizontal flip with p = 0.5 (``flip``; off for digits, whose meaning a flip changes);
- with p = 0.8, brightness +U(−0.4, 0.4) and contrast ×U(0.6, 1.4) about each image's mean (in standardised
  units: the jitter's size relative to the pixel spread is that of the recipe);
- three-channel images only: grayscale (the channel mean) with p = 0.2.
Hue and saturation jitter are left out (kornia's versions need [0, 1] pixels, not the standardised ones).
Every random number comes from torch's global generator, which the client's round seeds, so a view is
the same in any worker. Inputs that are not images ([B, D] vectors) get Gaussian noise of std 0.1 and a
random 20 % of their entries zeroed instead.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from fedguide.registry import ConfigError


def _uniform(n: int, low: float, high: float, like: torch.Tensor) -> torch.Tensor:
    return low + (high - low) * torch.rand(n, device=like.device, dtype=torch.float32)


def crop_boxes(n: int, like: torch.Tensor, scale=(0.2, 1.0), ratio=(3 / 4, 4 / 3)) -> torch.Tensor:
    """[n, 2, 3] affine maps from the output grid to a random box inside the image (normalised coords)."""
    area = _uniform(n, *scale, like)
    log_r = _uniform(n, math.log(ratio[0]), math.log(ratio[1]), like)
    aspect = log_r.exp()
    sx = (area * aspect).sqrt().clamp(max=1.0)  # box width / image width
    sy = (area / aspect).sqrt().clamp(max=1.0)
    tx = (1 - sx) * _uniform(n, -1.0, 1.0, like)
    ty = (1 - sy) * _uniform(n, -1.0, 1.0, like)
    theta = torch.zeros(n, 2, 3, device=like.device, dtype=torch.float32)
    theta[:, 0, 0], theta[:, 0, 2], theta[:, 1, 1], theta[:, 1, 2] = sx, tx, sy, ty
    return theta


def view(x: torch.Tensor, flip: bool = True) -> torch.Tensor:
    """One random view of every sample of ``x`` (module docstring)."""
    if not x.dtype.is_floating_point:
        raise ConfigError("the self-supervised methods augment images or feature vectors; this data set's inputs are "
                          "token ids — choose an image data set")
    b = x.shape[0]
    if x.dim() != 4:
        keep = (torch.rand(x.shape, device=x.device) >= 0.2).to(x.dtype)
        return (x + 0.1 * torch.randn(x.shape, device=x.device, dtype=x.dtype)) * keep
    theta = crop_boxes(b, x)
    if flip:
        sign = torch.where(torch.rand(b, device=x.device) < 0.5, -1.0, 1.0)
        theta[:, 0, 0] = theta[:, 0, 0] * sign
    grid = F.affine_grid(theta.to(x.dtype), list(x.shape), align_corners=False)
    out = F.grid_sample(x, grid, mode="bilinear", padding_mode="border", align_corners=False)
    jitter = (torch.rand(b, device=x.device) < 0.8).view(b, 1, 1, 1)
    mean = out.mean(dim=(1, 2, 3), keepdim=True)
    contrast = _uniform(b, 0.6, 1.4, x).view(b, 1, 1, 1).to(x.dtype)
    brightness = _uniform(b, -0.4, 0.4, x).view(b, 1, 1, 1).to(x.dtype)
    out = torch.where(jitter, (out - mean) * contrast + mean + brightness, out)
    if x.shape[1] == 3:
        grey = (torch.rand(b, device=x.device) < 0.2).view(b, 1, 1, 1)
        out = torch.where(grey, out.mean(dim=1, keepdim=True).expand_as(out), out)
    return out
