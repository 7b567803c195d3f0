"""FedDDA (PRCV 2023; FedDifRC's Table 6 baseline "diffusion-based FL methods ... which build synthetic
datasets to enhance performance"): every client trains on its own data augmented with images the
guidance model generates for the classes it holds; server: FedAvg.

What FedDifRC's text gives is all this implements: the guidance model (Stable Diffusion in the paper,
``guidance:`` here) generates class-conditional images per client, and the clients train on real and
generated data together. The generation, the amount (``per_class``, default ``match``: as many generated
images as the client has real ones, spread evenly over its classes) and the way generated images join
the local batches are those of ``_generated_data.py``; its docstring lists the decisions neither paper
states. The FedDDA paper's own text and code were not at hand: check its generation prompt, amount and
mixing ratio against them when they are.

Global accuracy: the averaged model on the global test set (FedAvg's).
"""
from __future__ import annotations

import torch


from fedguide.methods.diffusion_guided._diffusion_features import GuidanceRecord
from fedguide.methods.diffusion_guided._generated_data import GeneratedData, GeneratedDataParams, extra_count, mix
from fedguide.methods.base import METHODS, Method


@METHODS.register("feddda", params=GeneratedDataParams)
class FedDDA(Method):
    """FedDDA: local training on real plus guidance-model-generated images of the client's classes; FedAvg."""

    extras = ("guidance",)  # built on the guidance model (diffusers, transformers)

    def __init__(self, params, run):
        super().__init__(params, run)
        self.generated = GeneratedData(run, params)

    def setup(self):
        record = GuidanceRecord(self.run, "feddda")
        record.note("generated_data", self.generated.setup())
        record.write()

    def begin_local(self, model, ctx) -> tuple[torch.Tensor, torch.Tensor]:
        # The round's state: the generated images of the client's classes and their labels.
        return self.generated.pool(ctx.client_id, ctx.payload["weights"].device)

    def local_loss(self, model, x, y, ctx, state: tuple[torch.Tensor, torch.Tensor]):
        pool_x, pool_y = state
        x, y = mix(x, y, pool_x, pool_y, extra_count(len(y), len(pool_y), len(ctx.data)))
        return super().local_loss(model, x, y, ctx, state)
