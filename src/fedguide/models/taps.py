"""Intermediate representations of an encoder, for objectives applied level by level (FedRCL).

A *level* is one stage of the encoder's top-level children. A stage opens at each child that carries
weights (a convolution, a linear layer, a residual block; normalisation layers do not open one, they
belong to the layer before them) and runs up to the next such child; parameter-free children before
the first one (a leading Flatten) join the first stage. A level's representation is either

- pre-activation (default): the input of the last activation function the stage applies (found
  among the stage's modules at any depth, so a residual block's final ReLU counts), or
- post-activation: the output of the stage's last child that is not a Flatten;

conv maps are global-average-pooled, then every representation is L2-normalised. A stage without an
activation module uses its output either way. For the models here:

- ``cnn``: conv-ReLU-pool, conv-ReLU-pool, FC-ReLU → 3 levels (32, 64, 512 dims); pre-activation
  they are the two conv outputs and the FC output before their ReLUs;
- ``resnet10``: stem, then each residual block (one per stage with blocks 1-1-1-1; the last one
  pooled) → 5 levels (64, 64, 128, 256, 512); pre-activation a block's level is its residual sum
  before the final ReLU, as FedRCL's released code taps it;
- ``mlp``: the two hidden layers → 2 levels.

``FeatureTap`` collects them with hooks on the one live model. Hooks must not outlive the client that
installed them (the live model is reused by every client and by evaluation): ``attach`` first
removes any hooks it still holds, and ``detach`` removes them all.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.hooks import RemovableHandle

_NORMALISATION = (nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LayerNorm, nn.LocalResponseNorm)
_ACTIVATION = (nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.PReLU, nn.ELU, nn.SELU, nn.CELU, nn.GELU, nn.SiLU,
               nn.Mish, nn.Hardswish, nn.Hardtanh, nn.Sigmoid, nn.Tanh)


def _opens_stage(module: nn.Module) -> bool:
    has_weights = next(module.parameters(), None) is not None
    return has_weights and not isinstance(module, _NORMALISATION)


def encoder_stages(encoder: nn.Module) -> list[list[str]]:
    """The encoder's top-level children grouped into stages (lists of child names), input to output."""
    children = list(encoder.named_children())
    if not children:
        raise ValueError(f"{type(encoder).__name__} has no child modules: its levels cannot be tapped")
    stages: list[list[tuple[str, nn.Module]]] = [[]]
    for name, module in children:
        if _opens_stage(module) and any(_opens_stage(m) for _, m in stages[-1]):
            stages.append([])
        stages[-1].append((name, module))
    return [[name for name, _ in stage] for stage in stages]


def level_representation(output: torch.Tensor) -> torch.Tensor:
    """(B, C, *spatial) → global average pool → (B, C); (B, d) stays; then L2-normalised rows."""
    if output.dim() > 2:
        output = output.flatten(2).mean(-1)
    return F.normalize(output.flatten(1), dim=1)


class FeatureTap:
    """Hooks on an encoder's stages; ``collect`` returns the representations of the last forward pass.

    Each representation is computed inside the hook, when its tensor is produced: an in-place op
    that runs later (``ReLU(inplace=True)`` right after the tapped point) cannot change it.
    """

    def __init__(self) -> None:
        self._handles: list[RemovableHandle] = []
        self._out: dict[int, torch.Tensor] = {}
        self._count = 0

    def attach(self, encoder: nn.Module, stages: list[list[str]], preactivation: bool = True) -> None:
        self.detach()
        for index, names in enumerate(stages):
            children = [encoder.get_submodule(n) for n in names]
            activations = [m for c in children for m in c.modules() if isinstance(m, _ACTIVATION)]
            if preactivation and activations:
                # Every activation call in the stage overwrites the level: the last one wins.
                hook = functools.partial(self._pre_hook, index)
                self._handles += [m.register_forward_pre_hook(hook) for m in dict.fromkeys(activations)]
            else:
                last = [c for c in children if not isinstance(c, nn.Flatten)] or children
                self._handles.append(last[-1].register_forward_hook(functools.partial(self._hook, index)))
        self._count = len(stages)

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles, self._out, self._count = [], {}, 0

    def _pre_hook(self, index: int, module: nn.Module, inputs: tuple) -> None:
        x = inputs[0]
        # An in-place activation is about to overwrite x; F.normalize of a (B, d) input keeps a
        # reference to it for backward, so that case works on a copy (pooling copies already).
        self._out[index] = level_representation(x if x.dim() > 2 else x.clone())

    def _hook(self, index: int, module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        self._out[index] = level_representation(output)

    def collect(self) -> list[torch.Tensor]:
        """The levels of the forward pass just run, in level order; clears them."""
        if len(self._out) != self._count:
            raise RuntimeError(f"FeatureTap saw {len(self._out)} of its {self._count} levels; "
                               "run a forward pass of the tapped module before collect()")
        out = [self._out[i] for i in range(self._count)]
        self._out = {}
        return out
