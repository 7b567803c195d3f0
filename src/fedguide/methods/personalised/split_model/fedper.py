"""FedPer (Arivazhagan, Aggarwal, Singh & Choudhary, 2019, "Federated Learning with Personalization Layers").

The network is base layers W_B followed by K_P personalisation layers W_P. Each chosen client trains base
and personalisation layers together (e epochs of SGD on its data: the run's local loop), sends W_B only, and
the server averages the bases weighted by the clients' sample counts (W_B ← Σ_j n_j/n · W_B,j); the
personalisation layers stay on their client (its disk state) and never travel.

Where it is expected to lose: on the global test set under label skew, where its global accuracy scores each
client's personalisation layers, fitted to its own classes, on every class. On ``configs/demo.yaml`` (Dir 0.1,
seeds 0-2, last-2) that is 31.94 ± 2.16 % against FedAvg's 60.51 %, −28.57 [−39.78, −17.36] points paired
(benchmarks/results/method_defaults/demo.md); on the clients' own test splits (``eval.mode: both``) the same runs
score 88.81 ± 2.72 % against FedAvg's global model's 60.52 % there, +28.29 [+27.32, +29.26]
(benchmarks/results/method_defaults/demo_personal.md).

Defaults and decisions:
- ``personal_layers`` K_P = 1: the classification layer alone (the paper varies K_P; PFLlib's FedPer, a common
  reference implementation, keeps the head). A "layer" is a module owning parameters, counted from the
  output: K_P = 2 adds the last FC mapping layer (``model: {mapping: [...]}``), and so on; buffers in that
  range (batch statistics) are personal too.
- A client that has not trained yet starts from the run's seeded initial personalisation layers.
- Global accuracy (FedDW's protocol): the mean over all clients of their personalised models (the global
  base with their own personalisation layers) on the global test set; see ``_split_federation``.
  ``model.safetensors`` holds the averaged base with the initial personalisation layers. ``last_local_eval:
  true`` adds ``readings.last_local``: the clients' models as their last local training left them, their own
  trained base included (FedDW's ``inference_by_pFL``, ``utils.py`` L248-274, ``main.py`` L410).
- ``protocol: feddw`` (FedDW Tables I/IV, ``Updata.py`` L413-452: the averaged base loaded, every layer trained
  E epochs with one Adam, ``fc3`` kept): ``last_local_eval: true``; the local training is the run's already.
"""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from fedguide.methods._personalise import top_layers_start
from fedguide.methods.base import METHODS
from fedguide.methods.personalised._protocol import Protocol, apply_protocol, protocol_field
from fedguide.methods.personalised.split_model._split_federation import SplitFederation, last_local_field

PRESETS = {"feddw": {"last_local_eval": True}}


class FedPerParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    protocol: Protocol = protocol_field()
    personal_layers: int = Field(1, ge=1, description="K_P: the top layers kept on each client (1 = the "
                                                      "classification layer)")
    last_local_eval: bool = last_local_field()

    @model_validator(mode="before")
    @classmethod
    def _protocol(cls, data):
        return apply_protocol(data, PRESETS)


@METHODS.register("fedper", params=FedPerParams)
class FedPer(SplitFederation):
    """FedPer: base layers averaged, the top personal_layers layers kept on each client."""

    paper = "https://arxiv.org/abs/1912.00818"

    def setup(self) -> None:
        self._start = top_layers_start(self.run.layout, self.run.model, self.params.personal_layers,
                                       "personal_layers")

    def personal_start(self) -> int:
        return self._start
