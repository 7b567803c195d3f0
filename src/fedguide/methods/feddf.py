"""FedDF (Lin, Kong, Stich, Jaggi, NeurIPS 2020) as FedCADO's one-shot baseline: ensemble distillation of
the client models on the server's unlabeled public pool.

Clients train once to convergence and upload their models (``_one_shot.py``; heterogeneous
architectures through ``client_models``). The server starts the global model from the sample-weighted
average (FedAvg) of the uploads that share its architecture, and distils into it the ensemble of all
client models on the public pool (``data.public_fraction``; labels unused): the target of an image is
the softmax of the clients' averaged logits (FedDF's AVGLOGITS), the loss KL(target ‖ student) at
temperature T (times T²), Adam at lr 1e-3 (FedDF's optimiser) for ``distill_steps`` steps.

Decisions:
- One shot, as FedCADO's tables use it (rounds after the first are idle); FedDF's own multi-round form
  (distillation after every FedAvg round) is not provided.
- No client of the global architecture (every ``client_models`` entry differs from the model): the
  student starts from the run's initial weights.
- A fixed number of steps, no early stopping: FedDF stops on a validation set the server does not
  have here.
- No public pool (``data.public_fraction: 0``) is a configuration error naming the fix.
"""
from __future__ import annotations

import torch
from pydantic import Field

from fedguide.core.aggregation import sample_weighted_average
from fedguide.methods._distill import distillation_loss, fit, mean_logit_targets, predict_logits
from fedguide.methods._one_shot import OneShotMethod, OneShotParams, server_generator
from fedguide.methods.base import METHODS
from fedguide.registry import ConfigError


class FedDFParams(OneShotParams):
    distill_steps: int = Field(500, ge=1, description="optimiser steps of the server's distillation")
    distill_lr: float = Field(1e-3, gt=0.0, description="Adam learning rate of the distillation (FedDF: 1e-3)")
    distill_batch_size: int = Field(128, ge=1, description="public-pool images per distillation step")
    temperature: float = Field(1.0, gt=0.0, description="softmax temperature of teachers and student")


@METHODS.register("feddf", params=FedDFParams)
class FedDF(OneShotMethod):
    """FedDF: one shot; FedAvg of the clients, then distillation of their ensemble on the public pool."""

    Params = FedDFParams

    def setup(self) -> None:
        if len(self.run.data.public_indices) == 0:
            raise ConfigError("feddf distils the client models on the server's unlabeled public pool, and this "
                              "config has none; set data.public_fraction (e.g. data.public_fraction=0.1)")
        super().setup()

    def one_shot(self, uploads):
        run, p = self.run, self.params
        teachers = self.teachers(uploads)
        own_arch = [u for u in uploads if self.arch_of(int(u["client_id"])).position < 0]
        start = (sample_weighted_average([u["weights"] for u in own_arch], [u["num_samples"] for u in own_arch])
                 if own_arch else None)
        student = self.fresh_global(start)
        x = run.data.splits.train_x[torch.from_numpy(run.data.public_indices)]
        targets = mean_logit_targets([predict_logits(t, x) for t in teachers.values()], p.temperature)

        def batch_loss(model, idx):
            return distillation_loss(model(x[idx]), targets[idx], p.temperature)

        loss = fit(student, len(x), batch_loss, torch.optim.Adam(student.parameters(), lr=p.distill_lr),
                   p.distill_batch_size, server_generator(run.config.seed, 1), steps=p.distill_steps)
        self.stats.update({"public_images": int(len(x)), "distillation_loss": loss,
                           "fedavg_start_clients": len(own_arch)})
        return run.layout.flatten(student)
