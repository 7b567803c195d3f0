"""Representation alignment for the UNet stage (REPA: "Representation Alignment for Generation", Yu et
al., 2024): beside the ε-prediction loss, the hidden state of each block in ``repa_layers`` (hook names
of guidance/hooks.py: ``down.i``, ``mid``, ``up.i``) goes through a small head — REPA's per-position MLP,
here three 1x1 convolutions with SiLU (``repa_head: mlp``) — and is pulled towards a frozen encoder's view
of the *clean* image by a cosine loss, averaged over positions and blocks:

    loss = mse(ε̂, ε) + repa_weight * (1 - cos(head(h), target))

Targets (``repa_target``), computed once per pool image and kept in the partial folder until the models
are written (a run started again reads them; recomputing would give the same values):
- ``effnet``: the ImageNet EfficientNet-Lite0 feature map (1280 channels; 4 x 4 at the CLIP stage's
  ``clip_image_size`` of 128 px), average-pooled or bilinearly resized to the block's grid;
- ``clip``: the image's mini-CLIP embedding (its image token), the same at every position.

``repa_head: linear`` replaces the MLP by one 1x1 convolution, a departure from REPA: an MLP head lets the
block hold the target in any form the MLP can decode, whereas the linear probe of the features (and the
methods that read them: FedDifRC, SemanticFL) only see what a linear map can read.

The heads are trained with the UNet (same optimiser, kept in the checkpoints) and then discarded: the
written UNet is an ordinary ``UNet2DConditionModel``, so the loader and the methods cannot tell.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from fedguide.guidance.embedded.backbones import IMAGE_FEATURES, ImageBackbone
from fedguide.guidance.embedded.pretrain.partial import load_stage, save_atomic
from fedguide.guidance.embedded.pretrain.settings import PretrainSettings, stage_key
from fedguide.guidance.progress import progress

HEAD_WIDTH = 256


def block_channels(channels: tuple[int, ...], layers: tuple[str, ...]) -> dict[str, int]:
    """The output channels of each named block of a UNet with ``block_out_channels`` ``channels``."""
    def of(name: str) -> int:
        if name == "mid":
            return channels[-1]
        kind, i = name.split(".")
        return (channels if kind == "down" else channels[::-1])[int(i)]

    return {name: of(name) for name in layers}


def _head(channels: int, out: int, kind: str) -> torch.nn.Module:
    conv = torch.nn.Conv2d
    if kind == "linear":
        return conv(channels, out, 1)
    return torch.nn.Sequential(conv(channels, HEAD_WIDTH, 1), torch.nn.SiLU(), conv(HEAD_WIDTH, HEAD_WIDTH, 1),
                               torch.nn.SiLU(), conv(HEAD_WIDTH, out, 1))


class AlignHeads(torch.nn.Module):
    """One projection head per aligned block, from its channels to the target's."""

    def __init__(self, channels: dict[str, int], target_dim: int, kind: str = "mlp"):
        super().__init__()
        self.heads = torch.nn.ModuleDict({name.replace(".", "_"): _head(c, target_dim, kind)
                                          for name, c in channels.items()})

    def forward(self, name: str, hidden: torch.Tensor) -> torch.Tensor:
        return self.heads[name.replace(".", "_")](hidden)


def build_heads(s: PretrainSettings, context_dim: int) -> AlignHeads:
    """The heads of a run, seeded on their own (the UNet's initial weights do not depend on them)."""
    torch.manual_seed(s.seed + 8)
    target_dim = IMAGE_FEATURES if s.repa_target == "effnet" else context_dim
    return AlignHeads(block_channels(tuple(s.unet_channels), tuple(s.repa_layers)), target_dim, s.repa_head)


def alignment_targets(images: torch.Tensor, image_tokens: torch.Tensor, s: PretrainSettings,
                      quiet: bool, cache: Optional[Path] = None) -> torch.Tensor:
    """[N, D, g, g] per pool image: the backbone's feature map, or the image token as a 1 x 1 map.
    With ``cache`` (a stage file of the partial folder) the feature maps are computed once per settings:
    a run started again reads them instead of running the backbone over the pool again."""
    if s.repa_target == "clip":
        return image_tokens[:, :, None, None]
    key = stage_key(s, "repa_target", "clip_image_size")  # the pool (common keys) and the backbone's input
    done = load_stage(cache, key) if cache is not None else None
    if done is not None and tuple(done["targets"].shape[:1]) == (len(images),):
        return done["targets"]
    backbone = ImageBackbone(s.clip_image_size)
    maps = []
    with progress(len(images), "alignment targets", enabled=not quiet) as advance, torch.no_grad():
        for start in range(0, len(images), 256):
            maps.append(backbone.feature_map(images[start:start + 256]))
            advance(len(maps[-1]))
    targets = torch.cat(maps)
    if cache is not None:
        save_atomic({"key": key, "targets": targets}, cache)
    return targets


def resized(target: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """``target`` [B, D, g, g] on a block's grid ``size``."""
    if tuple(target.shape[-2:]) == size:
        return target
    if target.shape[-1] == 1:
        return target.expand(-1, -1, *size)
    if size[0] <= target.shape[-2] and size[1] <= target.shape[-1]:
        return F.adaptive_avg_pool2d(target, size)
    return F.interpolate(target, size=size, mode="bilinear", align_corners=False)


class Alignment:
    """The REPA term of a batch: the heads, every pool image's target and the blocks aligned."""

    def __init__(self, heads: AlignHeads, targets: torch.Tensor, layers: tuple[str, ...]):
        self.heads, self.targets, self.layers = heads, targets, tuple(layers)

    def loss(self, hidden: dict[str, torch.Tensor], idx: torch.Tensor) -> torch.Tensor:
        """1 - the mean cosine between each block's projected state and the clean images' targets."""
        target = self.targets[idx]
        terms = [1 - F.cosine_similarity(self.heads(name, h), resized(target, tuple(h.shape[-2:])), dim=1).mean()
                 for name, h in hidden.items()]
        return torch.stack(terms).mean()
