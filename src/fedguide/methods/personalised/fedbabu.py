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
for ``finetune_epochs`` epochs (released code: ``--ft_ep 5``) with the ``train`` section's optimiser (learning
rate ``finetune_lr``, default ``train.lr``); ``eval.finetune_steps`` does not apply. Fine-tuning the head alone
computes the frozen body's features once per client and trains the head on them (``train_head``), batch for
batch as through the body, wherever that gives the same result (a body without BatchNorm or dropout, no
``train.augment``): one pass of the body instead of one per epoch.

Defaults and decisions:
- ``finetune_part: head`` fine-tunes the head alone, as the paper's abstract words it; ``full`` fine-tunes body
  and head together (the released code's fine-tuning call passes the same learning rate to both), ``body``
  the body alone.
- Body averaging is sample-weighted (FedAvg's rule; the released code averages uniformly over the round's
  clients).
- Global accuracy (FedDW's protocol, the server's model): the averaged body with the fixed initial head on the
  global test set, without fine-tuning.
"""
from __future__ import annotations

from typing import Literal, Optional

import torch
from pydantic import BaseModel, ConfigDict, Field

from fedguide.core.aggregation import average_leading_part
from fedguide.methods._personalise import fine_tune, head_span
from fedguide.methods.base import METHODS, Method


class FedBABUParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    finetune_epochs: int = Field(5, ge=1, description="personalisation: epochs of fine-tuning on the client's data (τ_f)")
    finetune_part: Literal["head", "full", "body"] = Field(
        "head", description="personalisation: what is fine-tuned (head; full = body and head; body)")
    finetune_lr: Optional[float] = Field(None, gt=0.0, description="personalisation learning rate; null = train.lr")


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
        train = self.run.train
        train = train.model_copy(update={"epochs": self.params.finetune_epochs, "local_steps": None,
                                         "lr": self.params.finetune_lr or train.lr})
        return fine_tune(self.run, client_id, round_, global_weights, train, self.params.finetune_part)
