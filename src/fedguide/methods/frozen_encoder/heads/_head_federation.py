"""Multi-round federated training of a linear head on the frozen image encoder (FedDISC's multi-round
baselines FedAvg-sm, SemiFL and RSCFed; the FedDISC paper Sec. 4.1: "a composite of a pre-trained CLIP and
a linear classifier ... we freeze the pre-trained CLIP and only fine-tune the additional classifier").

The global model is the head {weight [C, D], bias [C]} on f = B·E(x)/‖E(x)‖ (see _frozen_encoder); it is
kept in the server state, sent as ``head_weight``/``head_bias`` and uploaded back with an aggregation
weight (``num_samples``) and the client's mean training loss (``train_loss``, reported as
``client_train_loss``). The run's own model and the default local loop are not used: ``fit`` trains
the head on its cached features with the ``train`` section's optimiser settings (``lr``,
``momentum``, ``weight_decay``, ``batch_size``, ``epochs``; ``local_steps`` does not apply). Evaluation:
encoder + global head on the test set.
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field

from fedguide.core.seeding import derive_seed, torch_generator
from fedguide.methods.frozen_encoder._frozen_encoder import (FrozenFeatures, Head, average_heads, class_prototypes,
                                             head_from_state, head_metrics, head_state, labeled_set, new_head, train_head)
from fedguide.methods.base import ClientContext, Method

HEAD_TAG, CLIENT_TAG, SERVER_TAG = 13, 31, 32


class HeadParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    feature_norm: Optional[float] = Field(
        None, gt=0.0,
        description="features are L2-normalised and scaled to this norm; null = √D (per-coordinate RMS 1)")
    unheld_per_class: int = Field(
        100, ge=1, description="labeled images per class the server takes from the unheld training images when the "
                               "run has neither a semi_supervised server set nor a public pool")


class HeadFederation(Method):

    on_device = False  # small models on cached features or its own loops: the host computes
    extras = ("guidance",)  # built on the guidance model (diffusers, transformers)
    needs_client_labels = False
    personal_evaluation = False  # the classifier is a head on the frozen encoder, not the run's model

    def setup(self) -> None:
        self.features = FrozenFeatures(self.run, self.params.feature_norm)
        self.head: Optional[Head] = None
        self.client_loss = float("nan")
        self._prototypes: Optional[tuple[torch.Tensor, torch.Tensor]] = None

    # ---- server-side pieces ----
    def labeled(self) -> tuple[np.ndarray, torch.Tensor, torch.Tensor]:
        """(indices, features, labels) of the server's labeled set."""
        idx, _ = labeled_set(self.run, self.params.unheld_per_class)
        return idx, self.features.train(idx), self.run.data.splits.train_y[torch.as_tensor(idx)]

    def prototypes(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._prototypes is None:
            _, x, y = self.labeled()
            self._prototypes = class_prototypes(x, y, self.run.num_classes)
        return self._prototypes

    def initial_head(self) -> Head:
        return new_head(self.features.dim, self.run.num_classes, derive_seed(self.run.seed, "model", HEAD_TAG))

    def global_head(self) -> Head:
        if self.head is None:
            self.head = self.initial_head()
        return self.head

    def extra_payload(self, round_: int) -> dict[str, Any]:
        return {}

    def server_payload(self, round_, client_id, global_weights):
        head = self.global_head()
        return {"head_weight": head["weight"], "head_bias": head["bias"], **self.extra_payload(round_)}

    def server_generator(self, round_: int, tag: int = SERVER_TAG) -> torch.Generator:
        return torch.Generator().manual_seed(derive_seed(self.run.seed, "sampling", round_, tag) % 2 ** 63)

    # ---- client ----
    def client_start(self, ctx):
        return self.run.initial_weights  # the engine's model is not used

    def fit(self, model, ctx, train):
        # The client trains the received head on its frozen-encoder features; the run's live model takes no
        # step (its loss stays out of the round's ``loss``; the head's is ``client_train_loss``).
        # The round's state is the trained head with its loss and aggregation weight, for the upload.
        head = {"weight": ctx.payload["head_weight"], "bias": ctx.payload["head_bias"]}
        return None, self.client_train(head, ctx)

    def client_features(self, ctx: ClientContext) -> torch.Tensor:
        return self.features.train(ctx.data.indices.numpy())

    def client_generator(self, ctx: ClientContext) -> torch.Generator:
        return torch_generator(self.run.seed, "client", ctx.round, ctx.client_id, CLIENT_TAG)

    def client_train(self, head: Head, ctx: ClientContext) -> tuple[Head, float, float]:
        """(trained head, mean loss, aggregation weight)."""
        raise NotImplementedError

    def client_upload(self, model, ctx, state: tuple[Head, float, float]):
        trained, loss, weight = state
        return {"head_weight": trained["weight"], "head_bias": trained["bias"], "num_samples": weight,
                "train_loss": loss}

    def train_supervised(self, head: Head, x: torch.Tensor, y: torch.Tensor, epochs: int, generator: torch.Generator,
                         lr: Optional[float] = None) -> tuple[Head, float]:
        t = self.run.train
        return train_head(head, x, y, epochs, lr if lr is not None else t.lr, t.batch_size, t.momentum,
                          t.weight_decay, generator)

    # ---- aggregation and evaluation ----
    def fedavg(self, uploads: list[dict]) -> Optional[Head]:
        """Sample-weighted mean of the uploaded heads; None if every weight is zero."""
        weights = [float(u["num_samples"]) for u in uploads]
        if not uploads or sum(weights) <= 0:
            return None
        return average_heads([{"weight": u["head_weight"], "bias": u["head_bias"]} for u in uploads], weights)

    def server_update(self, round_: int, uploads: list[dict]) -> Head:
        averaged = self.fedavg(uploads)
        return averaged if averaged is not None else self.global_head()

    def aggregate(self, round_, global_weights, uploads):
        self.global_head()
        self.head = self.server_update(round_, uploads)
        losses = [u["train_loss"] for u in uploads if np.isfinite(u["train_loss"])]
        self.client_loss = float(np.mean(losses)) if losses else float("nan")
        return global_weights

    def evaluate(self, round_, global_weights):
        out = head_metrics(self.run, self.global_head(), self.features.test())
        out["client_train_loss"] = self.client_loss
        return out

    # ---- checkpoints ----
    def server_state(self):
        return head_state(self.head)

    def load_server_state(self, state):
        if state:
            self.head = head_from_state(state, type(self).__name__)
