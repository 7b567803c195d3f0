"""Feature alignment to a pretrained image encoder by L2: the comparison rows of FedDifRC's Table 8.

A baseline, not FedDifRC: local objective L = CE + λ·mean_i ‖z_i − P e(x_i)‖², with e the guidance
model's image encoder (the embedded mini CLIP by default; ``guidance.image_encoder`` picks another CLIP: the
CLIP-ViT-B/16 row) or, with ``encoder``, a self-supervised ViT (guidance/vit_encoder.py): a ViTMAE (the
MAE-ViT-B/16 row: ``method.encoder=facebook/vit-mae-base``) or a DINO ViT (the DINO-ViT-B/16 row:
``method.encoder=facebook/dino-vitb16``), embedding an image by its class token (``pooling: cls``). P is a fixed, seeded linear map from e's dim to
z's (Gaussian / √D, never trained); server: FedAvg.
``normalize: true`` (default) aligns the L2-normalised z with the L2-normalised P e; ``false`` the raw vectors.

Decisions
- The ViT encoders' embedding is the last layer's class token (what their own linear probes read; the
  paper does not say which); ``pooling: mean`` averages the patch tokens instead. Offline, a hub id not in
  the local cache stops the run at setup with the download command.
- e(x) does not depend on the model: computed once on the server for every sample a client trains on,
  cached in the FeatureStore (key: the pipeline's fingerprint, which covers its own image encoder, plus
  ``guidance.image_encoder`` when another is named; the ViT's own fingerprint and pooling with ``encoder``)
  and looked up by the batch's global sample indices.
- λ = 1 (the paper states "aligned by L2 loss" and no weight) on L2-normalised vectors by default
  (``normalize: true``). The literal raw form (``normalize: false``) cannot work with an encoder whose z
  is a ReLU output: z ≥ 0 cannot match the signed P e, whose squared norm (~200 for the embedded mini
  CLIP, ‖e‖ ≈ 12) dwarfs the cross-entropy; the gradient drives z to 0 (dead ReLUs) and the model stays
  at chance (measured on configs/smoke.yaml: 10.0 % after 3 rounds, train loss 447 → 273; normalised:
  45.2 %, FedAvg 42.1 %). The normalised loss is bounded by 4, so CE keeps its weight.

Setting chosen for the embedded benchmark (configs/demo.yaml's ``method_options``; benchmarks/guidance_study.py,
chosen on a validation tenth of the training data, seeds 0-2): λ = 16 (16x the default), +12.75 [+8.08, +18.42]
points of last-k test accuracy over FedAvg, 2.76 below FedRCL; at λ = 1 it is +0.16, and λ = 64 scores lower on
validation. The default stays 1.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field

from fedguide.guidance.shared import feature_store, guidance_model
from fedguide.guidance.store import FeatureKey
from fedguide.guidance.vit_encoder import Pooling
from fedguide.methods.diffusion_guided._diffusion_features import (ClientTargets, GuidanceRecord, RowLookup, cached_features,
                                                  data_recipe, digest, guidance_images, timed, training_rows)
from fedguide.methods.base import METHODS, Method
from fedguide.registry import ConfigError


class AlignFeaturesParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lam: float = Field(1.0, ge=0.0, description="weight of the L2 alignment term")
    normalize: bool = Field(True, description="align L2-normalised z and P e (false: the raw L2 distance)")
    extract_batch: int = Field(64, ge=1)
    seed: int = Field(0, ge=0, description="seed of the fixed map P")
    encoder: Optional[str] = Field(
        None, description="a self-supervised ViT instead of the guidance model's image encoder: hub id or folder of a "
                          "ViTMAE (MAE: facebook/vit-mae-base), ViT (DINO: facebook/dino-vitb16) or Dinov2 model")
    pooling: Pooling = Field("cls", description="the ViT encoder's embedding: its class token or its mean patch token")


def alignment_loss(z: torch.Tensor, target: torch.Tensor, normalize: bool = False) -> torch.Tensor:
    """Batch mean of ‖z_i − target_i‖² (of the L2-normalised vectors with ``normalize``)."""
    if normalize:
        z, target = F.normalize(z, dim=1), F.normalize(target, dim=1)
    return (z - target).square().sum(dim=1).mean()


@dataclass
class AlignRound:
    """A client's round: its samples' encoder embeddings (``ClientTargets``, by batch) and the map P."""

    embeds: Any
    map: torch.Tensor


@METHODS.register("align_features", params=AlignFeaturesParams)
class AlignFeatures(Method):
    """CE + λ‖z − P e(x)‖² with e a pretrained image encoder (FedDifRC Table 8 baseline), FedAvg."""

    paper = "https://github.com/hwang52/FedDifRC"

    extras = ("guidance",)  # built on the guidance model (diffusers, transformers)
    def setup(self):
        p, run = self.params, self.run
        encoder, model_id = self._encoder()
        z_dim = int(run.model.feature_dim)
        self.map = torch.randn(z_dim, encoder.dim, generator=torch.Generator().manual_seed(p.seed)) / encoder.dim ** 0.5
        rows = training_rows(run)
        self._rows = RowLookup(rows)
        record = GuidanceRecord(run, "align_features")
        data = run.data_settings
        key = FeatureKey(model=model_id, dataset=data.name, split="train", fraction=data.fraction,
                         seed=0, recipe={"role": "image_encoder", "dim": encoder.dim,
                                         "image_encoder": self._encoder_name(),
                                         "data": data_recipe(data),
                                         "samples": digest(rows), "num_samples": int(len(rows))})

        def embed(b):
            with torch.no_grad():
                return encoder.embed(guidance_images(run, b)).float().cpu()

        store = feature_store(run.guidance)
        self._embeds, seconds = timed(lambda: cached_features(store, key, rows, embed, p.extract_batch,
                                                              run.guidance.rebuild and record.first,
                                                              "image encoder features"))
        record.note("image_features", {"folder": str(store.path(key)), "seconds": round(seconds, 3),
                                       "shape": list(self._embeds.shape)})
        record.note("encoder", self._encoder_name())
        record.write()

    def _encoder_name(self) -> str:
        if self.params.encoder is not None:
            return f"{self.params.encoder} ({self.params.pooling} token)"
        return self.run.guidance.image_encoder or "pipeline"

    def _encoder(self):
        """(the frozen image encoder, the model id keying its cached features)."""
        p, guidance = self.params, self.run.guidance
        if p.encoder is not None:  # a ViT of its own: the guidance pipeline is not needed
            from fedguide.guidance.components import resolve_device, resolve_dtype
            from fedguide.guidance.vit_encoder import load_vit_encoder

            device = resolve_device(guidance.device)
            encoder = load_vit_encoder(p.encoder, None, device, resolve_dtype(guidance.dtype, device), p.pooling)
            return encoder, encoder.model_id
        model = guidance_model(guidance, self.run)
        if model.image_encoder is None:
            raise ConfigError("align_features needs an image encoder: the guidance pipeline has none; set "
                              "guidance.image_encoder to a CLIP hub id or folder, method.encoder to a ViTMAE or DINO "
                              "model, or use guidance.model=embedded")
        return model.image_encoder, model.model_id

    def local_loss(self, model, x, y, ctx, state: Optional[AlignRound]):
        z, logits = model.forward_features(x)
        loss = F.cross_entropy(logits, y)
        if self.params.lam > 0:
            target = state.embeds(ctx) @ state.map.T
            loss = loss + self.params.lam * alignment_loss(z, target.to(z.dtype), self.params.normalize)
        return loss

    def begin_local(self, model, ctx) -> Optional[AlignRound]:
        if not self.params.lam > 0:
            return None
        # The client's embeddings and the map go to the device once per round.
        return AlignRound(ClientTargets(self._embeds, self._rows, ctx, len(self.run.data.splits.train_y), ctx.device),
                          self.map.to(ctx.device))
