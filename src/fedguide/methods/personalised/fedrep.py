"""FedRep (Collins, Hassani, Mokhtari & Shakkottai, ICML 2021, "Exploiting Shared Representations for
Personalized Federated Learning").

The model is a shared representation φ (here ``model.encoder``: the feature extractor and any mapping
layers) and a client-specific head h_i (``model.head``, the classification layer). In each round a chosen
client, starting from the global φ and its own h_i:
1. updates the head for τ_h epochs with φ fixed: h_i ← GRD(f_i(h_i, φ), h_i, η) (``head_epochs``);
2. then updates the representation for τ_φ epochs with its new head fixed: φ_i ← GRD(f_i(h_i, φ), φ, η)
   (``body_epochs``);
and uploads φ_i only; the server averages the representations. The head never leaves the client: it is kept
in the client's disk state and is not part of any upload.

Defaults and decisions:
- ``head_epochs`` 10: the paper's local epochs for the head (its released code runs local_ep 10 with
  local_rep_ep 1, i.e. 9 head epochs and 1 representation epoch).
- ``body_epochs`` null = the run's ``train.epochs`` (``train.local_steps`` steps when set): the paper's 1 is
  the default of ``train.epochs``; following the run's setting keeps FedRep's representation update as long as
  the other methods' local training under a shared protocol (FedDW: E = 5 for every method).
- Both phases use the ``train`` section's optimiser settings (a fresh optimiser per phase, as the released code
  builds one per call) and plain cross-entropy. The head phase trains on the fixed representation's features
  computed once per round, batch for batch as through φ, where that gives the same result (no BatchNorm or
  dropout in φ, no ``train.augment``; ``train_head``): one pass of φ instead of τ_h.
- Representation averaging is sample-weighted (FedAvg's rule; the released code averages uniformly over the
  round's clients).
- A client that has not trained yet starts from the run's seeded initial head.
- Global accuracy (FedDW's protocol): the mean over all clients of their personalised models (global φ with
  their own head) on the global test set; see ``_split_federation``. ``model.safetensors`` holds the averaged
  representation with the initial head.
"""
from __future__ import annotations

from typing import Optional

from pydantic import BaseModel, ConfigDict, Field

from fedguide.core.training import train_local
from fedguide.methods._personalise import frozen, head_span, train_head
from fedguide.methods.personalised._split_federation import SplitFederation
from fedguide.methods.base import METHODS


class FedRepParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    head_epochs: int = Field(10, ge=1, description="local epochs of the head with the representation fixed (τ_h)")
    body_epochs: Optional[int] = Field(
        None, ge=1, description="local epochs of the representation with the new head fixed (τ_φ); "
                                "null = train.epochs (train.local_steps steps when set)")


@METHODS.register("fedrep", params=FedRepParams)
class FedRep(SplitFederation):
    """FedRep: shared representation averaged, local head trained first each round; the head never leaves the client."""

    paper = "https://arxiv.org/abs/2102.07078"

    def personal_start(self) -> int:
        return head_span(self.run.layout).start

    def fit(self, model, ctx, train):
        head = train.model_copy(update={"epochs": self.params.head_epochs, "local_steps": None})
        body = train if self.params.body_epochs is None else \
            train.model_copy(update={"epochs": self.params.body_epochs, "local_steps": None})
        with frozen(model, "body"):
            head_loss, head_steps = train_head(model, ctx, self.local_train(head))
        with frozen(model, "head"):
            body_loss, body_steps = train_local(model, self, ctx, self.local_train(body), ctx.generator)
        ctx.steps = head_steps + body_steps
        phases = [(loss, steps) for loss, steps in ((head_loss, head_steps), (body_loss, body_steps)) if steps]
        return (sum(loss * steps for loss, steps in phases) / ctx.steps if phases else None), None
