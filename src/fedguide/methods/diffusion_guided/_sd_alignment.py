"""Targets of the L2 alignment to Stable Diffusion's features (FedRCL's † variant in FedDifRC's Table 6:
"align SD features (the image is fed directly into the SD model) by L2 loss").

The feature of a training image x: its VAE latent, not noised (t = 0: the image as it is), one UNet pass
with the empty prompt, global average pooling of the output of every UNet block (down.0-3, mid, up.0-3,
SemanticFL's layer set), concatenated: e(x) ∈ R^D. The target of z is P e(x), P a fixed, seeded Gaussian
map from D to z's dims (/√D, never trained), and the term is align_features' ‖ẑ − (P e)^‖² of the
L2-normalised vectors (batch mean): the same alignment as FedDifRC's Table 8 rows, with the diffusion
model as the encoder.

Input size: the images are resized to FedDifRC's guidance input size before the VAE, not fed at the data's
own: the setting and its resolution are feddifrc's ``image_size`` (``paper`` = 224 px on Stable Diffusion, Sec.
4.1 and the released code's ``--diffu_size 224``, hwang52/FedDifRC utils/options.py L29; fedguide's own 32-px
models take their own size, as feddifrc's features there), through the same ``input_size`` with feddifrc's
``PAPER_IMAGE_SIZE``; FedRCL's ``sd_image_size`` selects it (``native`` = the data's, as before this option:
a CIFAR image at 32 px is 4 x 4 SD latents). The size is in the feature-cache key and the run's record.

Decisions (the paper gives no more than the sentence above): t = 0 and the empty prompt (the image "fed
directly", no text), every block pooled, the fixed map P and the normalised L2 of align_features (whose
docstring measures why the raw form fails on a ReLU z). e(x) does not depend on the model being trained:
computed once on the server before round 1 for every sample a client trains on and cached in the feature
store. Generated images (FedRCL ◇+†) have no cached feature: the term covers a batch's real samples.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from fedguide.guidance.pipeline_facts import ImageSize
from fedguide.methods.diffusion_guided.feddifrc import PAPER_IMAGE_SIZE as FEDDIFRC_IMAGE_SIZE

ALL_BLOCKS = ("down.0", "down.1", "down.2", "down.3", "mid", "up.0", "up.1", "up.2", "up.3")


@dataclass
class SDRound:
    """A client's round: its samples' features (``ClientTargets``, by batch) and the map, where the run computes."""

    features: Any
    map: torch.Tensor


class SDFeatureTargets:
    def __init__(self, run, image_size: ImageSize = "paper", seed: int = 0, extract_batch: int = 32,
                 layers=ALL_BLOCKS):
        from fedguide.methods.diffusion_guided._diffusion_features import input_size

        self.run, self.seed, self.extract_batch, self.layers = run, seed, extract_batch, tuple(layers)
        self.requested_size = image_size
        # FedDifRC's size, resolved as feddifrc resolves its own (None until the pipeline's configs can be read).
        self.image_size: Optional[int] = input_size(run, image_size, FEDDIFRC_IMAGE_SIZE)
        self.map: Optional[torch.Tensor] = None

    def setup(self) -> dict:
        """Extracts (or finds in the cache) every training sample's pooled UNet features; returns the record."""
        from fedguide.guidance.features import DiffusionFeatures, FeatureSpec
        from fedguide.guidance.fused import spatial_pool
        from fedguide.guidance.shared import feature_store, guidance_model
        from fedguide.guidance.store import FeatureKey
        from fedguide.methods.diffusion_guided._diffusion_features import (RowLookup, cached_features, data_recipe, digest,
                                                          guidance_images, input_size_note, loaded_input_size,
                                                          prompt_maps, timed, training_rows)

        run = self.run
        model = guidance_model(run.guidance, run)
        if self.image_size is None:
            self.image_size = loaded_input_size(run, self.requested_size, FEDDIFRC_IMAGE_SIZE)
        feats = DiffusionFeatures(model, FeatureSpec(self.layers, t=0, noise_seed=self.seed,
                                                     extra={"role": "sd_alignment"}, image_size=self.image_size))
        tokens = model.encode_text(("",)).tokens
        rows = training_rows(run)
        self._rows = RowLookup(rows)

        def pooled(b: np.ndarray) -> torch.Tensor:
            maps = prompt_maps(feats, guidance_images(run, b), b, tokens, torch.zeros(len(b), 1, dtype=torch.long))
            return torch.cat([spatial_pool(maps[layer], "mean") for layer in self.layers], dim=1).float().cpu()

        data = run.data_settings
        key = FeatureKey(model=model.model_id, dataset=data.name, split="train", fraction=data.fraction,
                         seed=self.seed, recipe={"spec": feats.spec.as_dict(), "pooling": "mean", "prompt": "",
                                                 "data": data_recipe(data), "samples": digest(rows),
                                                 "num_samples": int(len(rows))})
        store = feature_store(run.guidance)
        self.features, seconds = timed(lambda: cached_features(store, key, rows, pooled, self.extract_batch,
                                                               run.guidance.rebuild, "SD features (FedRCL †)"))
        width, z_dim = int(self.features.shape[1]), int(run.model.feature_dim)
        self.map = torch.randn(z_dim, width, generator=torch.Generator().manual_seed(self.seed)) / width ** 0.5
        return {"folder": str(store.path(key)), "seconds": round(seconds, 3), "shape": list(self.features.shape),
                "layers": list(self.layers), "image_size": input_size_note(self.requested_size, self.image_size, model)}

    def begin(self, ctx) -> "SDRound":
        """The client's features and the map on the run's device, once per round."""
        from fedguide.methods.diffusion_guided._diffusion_features import ClientTargets

        return SDRound(ClientTargets(self.features, self._rows, ctx, len(self.run.data.splits.train_y), ctx.device),
                       self.map.to(ctx.device))

    def targets(self, ctx, like: torch.Tensor, state: "SDRound") -> torch.Tensor:
        """P e(x) [B, z dim] of the batch's samples, in ``like``'s dtype (looked up on the device)."""
        e = state.features(ctx).to(like.dtype)
        return e @ state.map.to(like.dtype).T
