"""FedBABU (Oh, Kim & Yun, ICLR 2022, "FedBABU: Toward Enhanced Representation for Federated Image
Classification").

Federated training updates and aggregates only the body (``model.encoder``: the feature extractor and any
mapping layers); the head (``model.head``, the classification layer) keeps its random initialisation on every
client and at the server and is never updated. The head is fine-tuned for personalisation during the
evaluation process.

Implementation: the head's gradients are dropped after each backward pass (``after_backward``), so no
optimiser step moves it, momentum and weight decay included (the released code trains with head_lr = 0, which
also leaves it fixed); the local loop is otherwise the run's, so regularisers compose. The server sends the
body only (the head is the run's seeded initial head, the same in every process), clients upload their body,
and the server averages the bodies; the global head stays the initial one.

Personalisation (``eval.mode: personal | both``): each client fine-tunes the global model on its training data
for ``finetune_epochs`` epochs; ``eval.finetune_steps`` does not apply. As released (github.com/jhoon-oh/FedBABU,
``analysis.ipynb``, "Initial / Personalized Accuracy", cell 2: L6 ``personalization_epoch = 5``, L22 ``lr 1e-3``,
L4 ``momentum 0.90``, L87-101 one SGD over body and head at that rate, no weight decay): 5 epochs of
``finetune_part: full`` with ``finetune_optimizer: sgd`` at ``finetune_lr`` 1e-3 and ``finetune_momentum`` 0.9.
``finetune_optimizer: train`` uses the ``train`` section's optimiser instead (its momentum and weight decay)
at ``finetune_lr`` (null: ``train.lr``). Batches: the run's ``train.batch_size`` (released: 50). Fine-tuning
the head alone computes the frozen body's features once per client and trains the head on them
(``train_head``), batch for batch as through the body, wherever that gives the same result (a body without
BatchNorm or dropout, no ``train.augment``): one pass of the body instead of one per epoch.

Defaults and decisions:
- ``finetune_part: full`` (released) fine-tunes body and head together; ``head`` the head alone, as the paper's
  abstract words it (fedguide's earlier default, with the run's optimiser at ``train.lr``); ``body`` the body
  alone.
- Body averaging is sample-weighted (FedAvg's rule; the released code averages uniformly over the round's
  clients).
- Global accuracy (FedDW's protocol, the server's model, ``main.py`` L456 of FedDW's released code): the averaged
  body with the fixed initial head on the global test set, without fine-tuning.
- ``protocol: feddw``: FedDW's code trains FedBABU as here (``Updata.py`` L377-408, the head's
  ``requires_grad`` off, ``main.py`` L420-421) and fine-tunes nothing; the personal accuracy fedguide adds
  beside Table I uses the released fine-tuning, which the preset sets explicitly.
"""
from __future__ import annotations

from typing import Literal, Optional

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from fedguide.core.aggregation import average_leading_part
from fedguide.methods._personalise import fine_tune, head_span
from fedguide.methods.base import METHODS, Method
from fedguide.methods.personalised._protocol import Protocol, apply_protocol, protocol_field

RELEASED_FINE_TUNING = {"finetune_epochs": 5, "finetune_part": "full", "finetune_lr": 0.001,
                        "finetune_optimizer": "sgd", "finetune_momentum": 0.9}
PRESETS = {"feddw": RELEASED_FINE_TUNING}


class FedBABUParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    protocol: Protocol = protocol_field()
    finetune_epochs: int = Field(5, ge=1, description="personalisation: epochs of fine-tuning on the client's data (τ_f)")
    finetune_part: Literal["full", "head", "body"] = Field(
        "full", description="personalisation: what is fine-tuned (full = body and head, released; head; body)")
    finetune_lr: Optional[float] = Field(0.001, gt=0.0, description="personalisation learning rate; null = train.lr")
    finetune_optimizer: Literal["sgd", "train"] = Field(
        "sgd", description="personalisation optimiser: sgd with finetune_momentum, no weight decay (released); "
                           "train: the train section's")
    finetune_momentum: float = Field(0.9, ge=0.0, lt=1.0, description="momentum of finetune_optimizer: sgd")

    @model_validator(mode="before")
    @classmethod
    def _protocol(cls, data):
        return apply_protocol(data, PRESETS)


@METHODS.register("fedbabu", params=FedBABUParams)
class FedBABU(Method):
    """FedBABU: only the body is trained and averaged; the head stays at its random initialisation."""

    paper = "https://arxiv.org/abs/2106.06042"

    def body_end(self) -> int:
        return head_span(self.run.layout).start

    def server_payload(self, round_, client_id, global_weights):
        return {"body": global_weights[: self.body_end()]}

    def client_start(self, ctx):
        return torch.cat([ctx.payload["body"], self.run.initial_weights[self.body_end():]])

    def after_backward(self, model, ctx, state):
        for p in model.head.parameters():
            p.grad = None  # an optimiser skips a parameter without a gradient entirely

    def client_upload(self, model, ctx, state):
        return {"body": self.run.layout.flatten(model)[: self.body_end()], "num_samples": len(ctx.data)}

    def aggregate(self, round_, global_weights, uploads):
        return average_leading_part(global_weights, [u["body"] for u in uploads],
                                    [u["num_samples"] for u in uploads])

    def personal_model(self, round_, client_id, global_weights):
        p, train = self.params, self.run.train
        update = {"epochs": p.finetune_epochs, "local_steps": None, "lr": p.finetune_lr or train.lr}
        if p.finetune_optimizer == "sgd":
            update.update(optimizer="sgd", momentum=p.finetune_momentum, weight_decay=0.0)
        train = train.model_copy(update=update)
        return fine_tune(self.run, client_id, round_, global_weights, train, self.params.finetune_part)
