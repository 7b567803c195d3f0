"""FedDDA (PRCV 2023; FedDifRC's Table 6 baseline "diffusion-based FL methods ... which build synthetic
datasets to enhance performance"): every client trains on its own data joined by images a diffusion model
generates, added where its label skew needs them; server: FedAvg weighted by real + generated samples.

Followed: the authors' released code (ZhZhuang/FedDDA, Fed_classifier/), in three parts:

- What a client gets (``add``; _generated_data.py says how, with the file and line of each rule):
  ``random`` (the reference's default, common.py L265): client k gets the k-th of ``n_block`` random
  slices of a class-balanced generated pool (``pool_per_class`` images of every class, by default twice
  the training samples per class as the released pool); ``lack``: every class client k has fewer than
  ⌊n_k/div⌋ samples of (``div`` 10) is filled up to ⌊n_k/div⌋ from that pool, so its missing and
  under-represented classes are added and the others are not.
- Local training: one shuffled pass per epoch over the client's real and generated samples together, in
  batches of ``train.batch_size`` (core_feddiffusion.py L101-108: a DataLoader over generated + real
  with shuffle=True, ``local_epoch`` passes), cross-entropy; generated images get ``train.augment`` as
  the real ones (the reference's one transform for both, common.py L73-92, L183-186).
- Aggregation: FedAvg weighted by each client's real + generated count (core_feddiffusion.py L102,
  L116-122: ``num_sample = len(generated + real)``).

Declared differences from the reference:
- The generator is the run's guidance model (``guidance:``, Stable Diffusion in FedDifRC's setting, the
  embedded models on a CPU), prompted with "a photo of a {class}". The reference trains a class-
  conditional DDIM federatedly on the clients' images (fed-ddim-main/, FedAvg over the clients'
  diffusion models) and samples its pool from it; that training stage is not reproduced.
- The reference's optimiser (Adam, lr 1e-3), batch size (128) and 5 local epochs (common.py L176,
  L252-255) are the run's ``train:`` settings here, as for every method of a comparison.
- Its sample filter (``filter_round``, cleanlab on the generated images, core_feddiffusion.py L136-160) is
  off by default in the reference (filter_round 99999, common.py L269) and not reproduced.

Each client's label histogram before (real), the generated counts and after (real + generated) are in
the run's guidance record (``guidance/feddda.json``, ``generated_data.histograms``); ``fedguide analyze RUN
--generated-data`` draws them as the partition heatmaps of ``fedguide report``, which shows them.

Global accuracy: the averaged model on the global test set (FedAvg's).
"""
from __future__ import annotations

from typing import Any, Optional

from fedguide.core.training import train_local
from fedguide.methods.diffusion_guided._diffusion_features import GuidanceRecord
from fedguide.methods.diffusion_guided._generated_data import AddedDataParams, GeneratedData
from fedguide.methods.base import METHODS, Method


@METHODS.register("feddda", params=AddedDataParams)
class FedDDA(Method):
    """FedDDA: local training on real plus generated images (random pool slices or a client's lacking classes);
    FedAvg weighted by real + generated samples."""

    extras = ("guidance",)  # built on the guidance model (diffusers, transformers)

    def __init__(self, params, run):
        super().__init__(params, run)
        self.generated = GeneratedData(run, params)

    def setup(self):
        record = GuidanceRecord(self.run, "feddda")
        record.note("generated_data", self.generated.setup())
        record.write()

    def fit(self, model, ctx, train) -> tuple[Optional[float], Any]:
        """One shuffled pass per epoch over the client's real and generated samples as one set; the round's
        state is that set's size, the client's FedAvg weight."""
        model.train()
        joined = self.generated.joined(ctx)
        loss, ctx.steps = train_local(model, self, joined, self.local_train(train), ctx.generator)
        return (loss if ctx.steps else None), len(joined.data)

    def client_upload(self, model, ctx, state: int):
        return {"weights": self.run.layout.flatten(model), "num_samples": state}
