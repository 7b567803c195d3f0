"""Hooked UNet features: the activations of chosen UNet blocks for one forward pass.

Layer names: ``down.i`` (output of down block i, before its skip connections are consumed), ``mid``,
``up.i`` (output of up block i, after its upsampler) and ``up.i.pre`` (the same block before its
upsampler, at the block's own resolution). Up block 0 is the lowest resolution, so FedDifRC's decoder
layer L ∈ {1..4} is ``up.{L-1}`` (``decoder_layer``).

The forward pass stops as soon as the last requested block has run (blocks run in the order down.*, mid,
up.*), so asking for ``mid`` costs half a UNet pass, not a whole one.
"""
from __future__ import annotations

import re
from contextlib import contextmanager
from typing import Iterator, Optional, Sequence

import torch

from fedguide.registry import ConfigError

_NAME = re.compile(r"^(down|up)\.(\d+)(\.pre)?$|^mid$")


class _Done(Exception):
    """Raised from a hook once every requested block has run: the rest of the UNet is skipped."""


def decoder_layer(level: int) -> str:
    """FedDifRC's decoder layer L (1 = lowest resolution) as a hook name."""
    return f"up.{level - 1}"


def layer_parts(name: str) -> tuple[str, int, bool]:
    """(kind, block index, before the upsampler) of a layer name: ("mid", 0, False) for ``mid``."""
    m = _NAME.match(name)
    if m is None:
        raise ConfigError(f"unknown UNet layer '{name}'; use down.i, mid, up.i or up.i.pre")
    if name == "mid":
        return "mid", 0, False
    return m.group(1), int(m.group(2)), m.group(3) is not None


def _module(unet, name: str):
    kind, i, pre = layer_parts(name)
    if kind == "mid":
        return unet.mid_block, False
    blocks = unet.down_blocks if kind == "down" else unet.up_blocks
    if i >= len(blocks):
        raise ConfigError(f"UNet layer '{name}': this UNet has {len(blocks)} {kind} blocks (0..{len(blocks) - 1})")
    block = blocks[i]
    if pre:
        if kind != "up" or getattr(block, "upsamplers", None) is None:
            raise ConfigError(f"UNet layer '{name}': up block {i} has no upsampler (the last up block has none); "
                              f"use up.{i}")
        return block.upsamplers[0], True
    return block, False


def layer_order(unet, layers: Sequence[str]) -> list[str]:
    """The requested layers in the order the UNet computes them."""
    def rank(name: str) -> tuple[int, int, int]:
        if name == "mid":
            return (1, 0, 0)
        kind, i, pre = _NAME.match(name).groups()
        return (0 if kind == "down" else 2, int(i), 0 if pre else 1)

    for name in layers:
        _module(unet, name)
    return sorted(dict.fromkeys(layers), key=rank)


@contextmanager
def capture(unet, layers: Sequence[str], stop_early: bool = True) -> Iterator[dict[str, torch.Tensor]]:
    """Within the context, every UNet forward fills the yielded dict with the layers' activations."""
    order = layer_order(unet, layers)
    out: dict[str, torch.Tensor] = {}
    handles = []
    for name in order:
        module, pre = _module(unet, name)

        def store(tensor: torch.Tensor, name: str = name) -> None:
            out[name] = tensor
            if stop_early and name == order[-1]:
                raise _Done

        if pre:
            handles.append(module.register_forward_pre_hook(lambda mod, args, store=store: store(args[0])))
        else:
            # Down blocks return (hidden states, skip states); the others a tensor.
            handles.append(module.register_forward_hook(
                lambda mod, args, output, store=store: store(output[0] if isinstance(output, tuple) else output)))
    try:
        yield out
    finally:
        for h in handles:
            h.remove()


def unet_features(model, latents: torch.Tensor, t: torch.Tensor | int, context: torch.Tensor,
                  layers: Sequence[str], class_labels: Optional[torch.Tensor] = None) -> dict[str, torch.Tensor]:
    """Activations [B, C_l, H_l, W_l] of ``layers`` for one pass of ``model``: a GuidanceModel's hooked UNet
    (``hooked_features``), or the maps a source without a UNet computes under the same names (the oracle)."""
    return model.block_maps(latents, t, context, layers, class_labels=class_labels)


def hooked_features(model, latents: torch.Tensor, t: torch.Tensor | int, context: torch.Tensor,
                    layers: Sequence[str], class_labels: Optional[torch.Tensor] = None) -> dict[str, torch.Tensor]:
    """Activations of ``layers`` for one UNet pass of a GuidanceModel, read by forward hooks."""
    with capture(model.unet, layers) as out:
        try:
            model.eps(latents, t, context, class_labels=class_labels)
        except _Done:
            pass
    return {name: out[name] for name in layers}
