"""FedBN (Li, Jiang, Zhang, Kamp & Dou, ICLR 2021, "FedBN: Federated Learning on Non-IID Features via Local
Batch Normalization").

Each client trains the whole model (the run's local loop) and keeps its BatchNorm layers (their affine weight
and bias and their running statistics) to itself; every other entry is averaged by the server. The official
code (med-air/FedBN, federated/fed_digits.py, ``communication``, lines 164-189) averages every state entry
whose name lacks "bn" with the weights ``client_weights = 1/client_num`` (line 247), copies the average back
into every client's model, and tests each client's model on that client's test set (lines 300-304).

Where it is expected to lose: on the global test set under label skew. FedBN is made for feature shift (each
client its own domain); its global accuracy scores each client's model, BatchNorm statistics fitted to its own
label mix, on every class. On ``configs/demo.yaml`` (Dir 0.1, seeds 0-2, last-k) that is 70.46 % against 76.65 % for
FedAvg on the same network with BatchNorm (``model.batch_norm: true``): −6.18 points paired (per seed −4.68,
−3.89, −9.98; interval [−14.40, +2.04]), more than its own seed spread of 4.30
(benchmarks/results/method_defaults/demo.md). On the clients' own test splits (``eval.mode: both``) label skew
gives it no clear win either: 73.22 ± 9.39 % against 76.64 % for FedAvg with BatchNorm, −3.43 [−24.68, +17.82]
(per seed +1.40, +1.62, −13.30; benchmarks/results/method_defaults/demo_personal.md). Compare it on a domain
partition with ``eval.mode: personal``, its own protocol.

Defaults and decisions:
- Local entries are found by module type, not by name: every entry of a BatchNorm layer (``torch.nn``'s
  ``_BatchNorm``: BatchNorm1d/2d/3d and SyncBatchNorm), whatever the model calls it. The method requires
  ``model.batch_norm: true`` (``model_requirements``): ``cnn`` then has FedBN's layers and ``mlp`` one after each
  hidden layer; ``resnet10`` and the other BatchNorm architectures declare it fixed. A model declaring it without
  any BatchNorm layer (a plug-in) is refused when the run is opened.
- ``weights: equal`` (the released code's 1/K over the round's clients; the paper's Alg. 1 writes the same
  plain mean) or ``samples`` (FedAvg's sample weights).
- Only the shared entries travel, in both directions; a client that has not trained yet starts from the run's
  seeded initial BatchNorm layers, as every model does in round 1. The server's global vector keeps the
  initial BatchNorm entries (the server model of the released code never receives them either).
- Accuracy: personalised methods have no server model to test (FedDW Sec. V-B's protocol, as FedRep and FedPer
  report it here): global accuracy is the mean over all clients of their own models (the averaged entries
  with their BatchNorm layers) on the global test set; ``eval.mode: personal | both`` scores the same models
  on each client's own test split, which is FedBN's protocol (on ``digits_domains`` with
  ``partition.name=domains``, each client's domain).
"""
from __future__ import annotations

from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch.nn.modules.batchnorm import _BatchNorm

from fedguide.core.aggregation import sample_weighted_average, weighted_average
from fedguide.methods._personalise import mean_client_metrics
from fedguide.methods.base import METHODS, Method
from fedguide.registry import ConfigError


class FedBNParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    weights: Literal["equal", "samples"] = Field(
        "equal", description="equal: 1/K over the round's clients (med-air/FedBN fed_digits.py line 247); "
                             "samples: by each client's training-set size (FedAvg's)")


def batch_norm_mask(layout, model: torch.nn.Module) -> torch.Tensor:
    """True on the flat vector's entries that belong to a BatchNorm layer (weights, biases, running statistics,
    the batch counter)."""
    norms = {name for name, module in model.named_modules() if isinstance(module, _BatchNorm)}
    return torch.cat([torch.full((int(torch.Size(shape).numel()),), name.rsplit(".", 1)[0] in norms,
                                 dtype=torch.bool) for name, shape in zip(layout.names, layout.shapes)])


@METHODS.register("fedbn", params=FedBNParams)
class FedBN(Method):
    """FedBN: every entry averaged except the BatchNorm layers, which stay on their client."""

    paper = "https://arxiv.org/abs/2102.07623"
    # A model with BatchNorm layers, declared (cnn, mlp: an option; resnet, mobilenet, ...: fixed), so that the
    # FedAvg it is compared with runs the same network (set model.batch_norm: true for every method).
    model_requirements = {"batch_norm": True}

    def setup(self) -> None:
        mask = batch_norm_mask(self.run.layout, self.run.model)
        if not bool(mask.any()):
            raise ConfigError(f"method.name=fedbn keeps the BatchNorm layers local, but model.name="
                              f"{self.run.model_name} has none; set model.batch_norm: true (cnn, mlp) or choose a "
                              "model with BatchNorm (resnet10)")
        # Index tensors, made once: gathering by them needs no host sync, a boolean mask would in every round.
        self._local = torch.nonzero(mask).flatten().to(self.run.device)
        self._shared = torch.nonzero(~mask).flatten().to(self.run.device)

    def own_norms(self, state: dict) -> torch.Tensor:
        """The client's BatchNorm entries: from its state, else the initial ones."""
        part = state.get("norms")
        return self.run.initial_weights[self._local] if part is None else part.to(self.run.device)

    def _assemble(self, shared: torch.Tensor, norms: torch.Tensor) -> torch.Tensor:
        out = torch.empty(self.run.layout.numel, dtype=shared.dtype, device=shared.device)
        out[self._shared] = shared
        out[self._local] = norms.to(shared.device)
        return out

    def server_payload(self, round_, client_id, global_weights):
        return {"shared": global_weights[self._shared]}

    def client_start(self, ctx):
        return self._assemble(ctx.payload["shared"], self.own_norms(ctx.state))

    def client_upload(self, model, ctx, state):
        flat = self.run.layout.flatten(model)
        ctx.update_state(norms=flat[self._local])
        return {"shared": flat[self._shared], "num_samples": len(ctx.data)}

    def aggregate(self, round_, global_weights, uploads):
        parts = [u["shared"] for u in uploads]
        shared = (weighted_average(parts, [1.0] * len(parts)) if self.params.weights == "equal"
                  else sample_weighted_average(parts, [u["num_samples"] for u in uploads]))
        out = global_weights.clone()
        out[self._shared] = shared
        return out

    def personal_model(self, round_, client_id, global_weights):
        return self._assemble(global_weights[self._shared], self.own_norms(self.run.store.get(client_id, round_)))

    def evaluate(self, round_, global_weights):
        return mean_client_metrics(self.run, lambda cid: self.personal_model(round_, cid, global_weights))
