"""FedRep (Collins, Hassani, Mokhtari & Shakkottai, ICML 2021, "Exploiting Shared Representations for
Personalized Federated Learning"); released code github.com/lgcollins/FedRep (``models/Update.py``,
``main_fedrep.py``, ``scripts/FedRep_*.sh``).

The model is a shared representation φ (here ``model.encoder``: the feature extractor and any mapping
layers) and a client-specific head h_i (``model.head``, the classification layer). In each round a chosen
client, starting from the global φ and its own h_i:
1. updates the head for τ_h epochs with φ fixed: h_i ← GRD(f_i(h_i, φ), h_i, η) (``head_epochs``);
2. then updates the representation for τ_φ epochs with its new head fixed: φ_i ← GRD(f_i(h_i, φ), φ, η)
   (``body_epochs``);
and uploads φ_i only; the server averages the representations. The head never leaves the client: it is kept
in the client's disk state and is not part of any upload.

Where it is expected to lose: on the global test set under label skew, where its global accuracy (FedDW's
protocol, below) scores each client's head, fitted to its own classes, on every class. On ``configs/demo.yaml``
(Dir 0.1, seeds 0-2, last-2) that is 35.53 ± 3.04 % against FedAvg's 60.51 %, −24.98 [−39.69, −10.27] points
paired (benchmarks/results/method_defaults/demo.md); on the clients' own test splits (``eval.mode: both``) the
same runs score 91.98 ± 1.87 % against FedAvg's global model's 60.52 % there, +31.47 [+28.51, +34.43]
(benchmarks/results/method_defaults/demo_personal.md): ``personal_accuracy`` is the reading FedRep is made to win.

Defaults and decisions:
- ``head_epochs`` 10: every released script runs ``local_ep − local_rep_ep`` = 10 head epochs
  (``lgcollins/FedRep/scripts/FedRep_cifar10_2shards.sh`` L5: ``--local_ep 11 --local_rep_ep 1``; the other six scripts
  ``--local_ep 15 --local_rep_ep 5``), as ``Update.py`` L593 (``head_eps = local_eps − local_rep_ep``) counts
  them; the representation then trains 1 epoch (CIFAR-10, 2 shards) or 5 (the others).
- ``body_epochs`` null = the run's ``train.epochs`` (``train.local_steps`` steps when set), so FedRep's
  representation update is as long as the other methods' local training under a shared protocol; ``rest`` =
  ``train.epochs − head_epochs``, the head's epochs counted inside the run's E (FedDW: ``Updata.py`` L489 and
  L519 run ``range(head_ep)`` then ``range(head_ep, client_epoch)``).
- ``optimizer: shared`` (default): one optimiser, the ``train`` section's, built once a round over the whole
  model and stepped through both phases, as ``Update.py`` L559-565 builds it before the epoch loop (L598). The
  released code ran on torch 0.4.1, whose ``zero_grad()`` zeroes a gradient rather than dropping it, so a
  part frozen in a phase is still stepped, with a zero gradient, once it has had one: in the representation
  epochs the head keeps moving by the optimiser's momentum (and weight decay), as there; the representation,
  which has no gradient yet in the head epochs, does not move in them. ``shared_kept_grads``: the same, on a
  client model kept across rounds with its zeroed gradients (FedDW: ``main.py`` L334-335 keeps
  ``client.model``; ``Updata.py`` L475 one Adam, torch 1.12): from a client's second round the representation
  is stepped with zero gradients in the head epochs too, which under Adam counts steps and so changes the bias
  correction of its first real steps (no weight decay: it does not move). ``per_phase``: a fresh optimiser per
  phase, the frozen part untouched (fedguide's earlier default).
- Plain cross-entropy in the head phase; the representation phase trains the method's objective (with any
  regulariser). The head phase trains on the fixed representation's features computed once per round, batch
  for batch as through φ, where that gives the same result (no BatchNorm or dropout in φ, no
  ``train.augment``, and φ not stepped in the head phase or without weight decay; ``train_head``): one pass of
  φ instead of τ_h.
- Representation averaging is sample-weighted (FedAvg's rule; ``main_fedrep.py`` weights by ``lens``, the
  clients' sample counts for FEMNIST and Sent140, L43-45, and ones for CIFAR, L30).
- A client that has not trained yet starts from the run's seeded initial head.
- Global accuracy (FedDW's protocol, Sec. V-B): the mean over all clients of their personalised models
  (global φ with their own head) on the global test set; see ``_split_federation``. ``last_local_eval: true``
  adds ``readings.last_local``, the clients' models as their last local training left them (FedDW's
  ``inference_by_pFL``). ``model.safetensors`` holds the averaged representation with the initial head.
- ``protocol: feddw`` (FedDW Tables I/IV, ``Updata.py`` L456-537, ``config.py`` ``head_ep=1``): 1 head epoch,
  ``body_epochs: rest`` (E − 1 = 4 at FedDW's E = 5), ``optimizer: shared_kept_grads``,
  ``last_local_eval: true``.
"""
from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

from fedguide.core.training import make_optimizer, train_local
from fedguide.methods._personalise import StepFrozen, frozen, head_span, train_head
from fedguide.methods.base import METHODS
from fedguide.methods.personalised._protocol import Protocol, apply_protocol, protocol_field
from fedguide.methods.personalised.split_model._split_federation import SplitFederation, last_local_field
from fedguide.registry import ConfigError

PRESETS = {"feddw": {"head_epochs": 1, "body_epochs": "rest", "optimizer": "shared_kept_grads",
                     "last_local_eval": True}}


class FedRepParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    protocol: Protocol = protocol_field()
    head_epochs: int = Field(10, ge=1, description="local epochs of the head with the representation fixed (τ_h)")
    body_epochs: Optional[Union[int, Literal["rest"]]] = Field(
        None, description="local epochs of the representation with the new head fixed (τ_φ); null = train.epochs "
                          "(train.local_steps steps when set); rest = train.epochs − head_epochs (FedDW)")
    optimizer: Literal["shared", "shared_kept_grads", "per_phase"] = Field(
        "shared", description="shared: one optimiser through both phases, frozen parts stepped with zero gradients "
                              "once they have had one (released code); shared_kept_grads: also the gradients a "
                              "client's model kept from its last round (FedDW); per_phase: a fresh one per phase")
    last_local_eval: bool = last_local_field()

    @model_validator(mode="before")
    @classmethod
    def _protocol(cls, data):
        return apply_protocol(data, PRESETS)

    @model_validator(mode="after")
    def _body_epochs(self) -> "FedRepParams":
        if isinstance(self.body_epochs, int) and self.body_epochs < 1:
            raise ValueError(f"body_epochs {self.body_epochs} is below 1; write a number of epochs, rest, or null")
        return self


@METHODS.register("fedrep", params=FedRepParams)
class FedRep(SplitFederation):
    """FedRep: shared representation averaged, local head trained first each round; the head never leaves the client."""

    paper = "https://arxiv.org/abs/2102.07078"

    def setup(self) -> None:
        if self.params.body_epochs == "rest":
            train = self.run.train
            if train.local_steps is not None:
                raise ConfigError("method.body_epochs: rest counts the epochs train.epochs leaves after the head's, "
                                  "but train.local_steps is set; unset train.local_steps or give body_epochs a number")
            if train.epochs <= self.params.head_epochs:
                raise ConfigError(f"method.body_epochs: rest leaves train.epochs − head_epochs = "
                                  f"{train.epochs - self.params.head_epochs} epochs for the representation; raise "
                                  f"train.epochs above {self.params.head_epochs} or lower method.head_epochs")

    def personal_start(self) -> int:
        return head_span(self.run.layout).start

    def _body_train(self, train):
        epochs = self.params.body_epochs
        if epochs is None:
            return train
        if epochs == "rest":
            epochs = train.epochs - self.params.head_epochs
        return train.model_copy(update={"epochs": epochs, "local_steps": None})

    def fit(self, model, ctx, train):
        p = self.params
        head = self.local_train(train.model_copy(update={"epochs": p.head_epochs, "local_steps": None}))
        body = self.local_train(self._body_train(train))
        if p.optimizer == "per_phase":
            with frozen(model, "body"):
                head_loss, head_steps = train_head(model, ctx, head)
            with frozen(model, "head"):
                body_loss, body_steps = train_local(model, self, ctx, body, ctx.generator)
        else:
            optimizer = make_optimizer(model, body)
            # The representation holds a (zeroed) gradient in the head epochs only on a client model kept from
            # an earlier round; the head holds one in the representation epochs once it has trained.
            kept = p.optimizer == "shared_kept_grads" and ctx.state.get("personal") is not None
            with frozen(model, "body"):
                head_loss, head_steps = train_head(
                    model, ctx, head, optimizer, StepFrozen(list(model.encoder.parameters()) if kept else []),
                    reuse=not kept or body.weight_decay == 0)  # zero steps move φ only through weight decay
            with frozen(model, "head"):
                stepped = list(model.head.parameters()) if head_steps or kept else []
                body_loss, body_steps = train_local(model, StepFrozen(stepped, self), ctx, body, ctx.generator,
                                                    optimizer=optimizer)
        ctx.steps = head_steps + body_steps
        phases = [(loss, steps) for loss, steps in ((head_loss, head_steps), (body_loss, body_steps)) if steps]
        return (sum(loss * steps for loss, steps in phases) / ctx.steps if phases else None), None
