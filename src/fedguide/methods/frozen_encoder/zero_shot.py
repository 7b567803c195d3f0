"""CLIP zero-shot (FedDISC's "CLIP Zero-shot" baseline, the FedDISC paper Sec. 4.1): every test image gets
the class whose prompt's text embedding is most similar (cosine) to its image embedding, with the guidance
model's image encoder and its aligned text tower. No client takes part in any way and nothing is trained.

Decisions: the prompt is the class name in ``prompt`` ("a photo of a {}", as FedDISC and the embedded mini
CLIP use); the scores are cos(E(x), T(prompt)) computed from the cached raw image embeddings, which is
``image_encoder.zero_shot(x, prompts)`` exactly. An image encoder without a text tower (an unCLIP
pipeline's image_encoder/) is a ConfigError naming the fix (a full CLIP model as guidance.image_encoder).
Every round reports the same accuracy; ``train.rounds: 1`` is enough.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field

from fedguide.methods.frozen_encoder._frozen_encoder import FrozenFeatures, score
from fedguide.methods.base import METHODS, Method
from fedguide.registry import ConfigError


class ZeroShotParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prompt: str = Field("a photo of a {}", description="class prompt template, filled with the lower-cased class name")


def zero_shot_scores(image_embeds: torch.Tensor, text_embeds: torch.Tensor) -> torch.Tensor:
    """Cosine similarities [N, P] between image and prompt embeddings."""
    return F.normalize(image_embeds.float(), dim=-1) @ F.normalize(text_embeds.float(), dim=-1).T


@METHODS.register("zero_shot", params=ZeroShotParams)
class ZeroShot(Method):
    """CLIP zero-shot: text-image similarity of the guidance model's image encoder; no training."""

    paper = "https://arxiv.org/abs/2305.04063"

    on_device = False  # small models on cached features or its own loops: the host computes
    extras = ("guidance",)  # built on the guidance model (diffusers, transformers)
    needs_client_labels = False
    personal_evaluation = False  # text-image similarity, no trained model

    def setup(self):
        self.features = FrozenFeatures(self.run)
        self._metrics = None

    def server_payload(self, round_, client_id, global_weights):
        return {}

    def client_start(self, ctx):
        return self.run.initial_weights

    def fit(self, model, ctx, train):
        return None, None  # nothing to train: the server classifies by text-image similarity

    def client_upload(self, model, ctx, state):
        return {}

    def aggregate(self, round_, global_weights, uploads):
        return global_weights

    def evaluate(self, round_, global_weights):
        if self._metrics is None:
            from fedguide.guidance.shared import class_prompts

            encoder = self.features.encoder
            if not encoder.can_zero_shot:
                raise ConfigError("zero-shot needs an image encoder with an aligned text tower; set "
                                  "guidance.image_encoder to a full CLIP model (e.g. openai/clip-vit-large-patch14) "
                                  "or use the embedded default")
            prompts = class_prompts(self.run.data.splits.class_names, self.params.prompt)
            sims = zero_shot_scores(self.features.raw_test(), encoder.embed_text(prompts).cpu())
            self._metrics = score(self.run, sims.argmax(1))
        return dict(self._metrics)
