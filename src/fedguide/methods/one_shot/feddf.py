"""FedDF (Lin, Kong, Stich, Jaggi, NeurIPS 2020) as FedCADO's one-shot baseline: ensemble distillation of
the client models on the server's unlabeled public pool.

Clients train once to convergence and upload their models (``_one_shot.py``; heterogeneous
architectures through ``client_models``). The server starts the global model from the sample-weighted
average (FedAvg) of the uploads that share its architecture, and distils into it the ensemble of all
client models on the public pool (labels unused): the target of an image is the softmax of the clients'
averaged logits (FedDF's AVGLOGITS), the loss KL(target ‖ student) at temperature T (times T²), Adam at
lr 1e-3 (FedDF's optimiser) for ``distill_steps`` steps.

The public pool (``public``):
- ``source: dataset``: the training images of another dataset, ``{source: dataset, name: <dataset>,
  <its parameters>}``, any entry of the dataset registry; FedCADO's tables distil on all of ImageNet
  ("we utilize the entire ImageNet", Sec. 4.1), e.g. ``{source: dataset, name: imagefolder, root:
  <ImageNet's train folder>, domain_level: false}``. Its images are brought to the run's format:
  pixels back to [0, 1] with the pool's own statistics, then the run's standardisation; RGB -> grey by
  the channel mean for one-channel data (grey -> RGB by repetition); ``image_size``, when the source has
  one and it is not given, is the run's. A pool that still cannot be fed to the model (another image
  size, token ids for an image model or images for a text model, token ids outside the model's
  vocabulary, an empty pool, no pixel statistics to convert with) is refused before any client trains:
  what the parameters show at set-up (``--dry-run``), the rest (a missing folder included) when the
  server loads the pool, before round 1's payloads.
- ``source: split`` (the default, so runs work offline): ``data.public_fraction`` of this run's own
  training set, held out from every client. It is not the paper's setting (the pool then comes from the
  clients' own distribution), and summary.json's ``method_params`` says ``public: {source: split}``.

Decisions:
- One shot, as FedCADO's tables use it (rounds after the first are idle); FedDF's own multi-round form
  (distillation after every FedAvg round) is not provided.
- No client of the global architecture (every ``client_models`` entry differs from the model): the
  student starts from the run's initial weights.
- A fixed number of steps, no early stopping: FedDF stops on a validation set the server does not
  have here.
- No public pool (``data.public_fraction: 0`` with ``source: split``) is a configuration error naming the fix.
- The pool is loaded on the server only (the first round's payloads), not by every client process, and
  held in memory as the run's own data is.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Literal, Optional

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from fedguide.core.aggregation import sample_weighted_average
from fedguide.data.sources import DATASETS, DatasetSplits
from fedguide.methods.one_shot._distill import distillation_loss, fit, mean_logit_targets, predict_logits
from fedguide.methods.one_shot._one_shot import OneShotMethod, OneShotParams, server_generator
from fedguide.methods.base import METHODS
from fedguide.registry import ConfigError


class PublicPool(BaseModel):
    """``method.public``: where the unlabeled distillation images come from (module docstring)."""

    model_config = ConfigDict(extra="allow")
    source: Literal["split", "dataset"] = Field(
        "split", description="split = data.public_fraction of this run's training set (offline stand-in); "
                             "dataset = the training images of the dataset ``name`` (FedCADO: ImageNet)")
    name: Optional[str] = Field(None, description="source dataset: a registered dataset (e.g. imagefolder)")

    @model_validator(mode="after")
    def _check(self) -> "PublicPool":
        extra = dict(self.model_extra or {})
        if self.source == "split":
            given = (["name"] if self.name is not None else []) + sorted(extra)
            if given:
                raise ValueError(f"public.source is split (data.public_fraction of this run's own training set); "
                                 f"the keys {', '.join(given)} are for source: dataset")
        elif not self.name:
            raise ValueError("public.source: dataset needs public.name, a dataset of `fedguide list` "
                             "(e.g. name: imagefolder, root: <folder of class folders>, domain_level: false)")
        else:
            DATASETS.parse_params(self.name, extra, "method.public")  # unknown keys are named now
        return self

    def dataset_params(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


class FedDFParams(OneShotParams):
    distill_steps: int = Field(500, ge=1, description="optimiser steps of the server's distillation")
    distill_lr: float = Field(1e-3, gt=0.0, description="Adam learning rate of the distillation (FedDF: 1e-3)")
    distill_batch_size: int = Field(128, ge=1, description="public-pool images per distillation step")
    temperature: float = Field(1.0, gt=0.0, description="softmax temperature of teachers and student")
    public: PublicPool = Field(default_factory=PublicPool,
                               description="the unlabeled pool: {source: split} or {source: dataset, name: ..., ...}")


def public_source_params(pool: PublicPool, splits: DatasetSplits) -> BaseModel:
    """The pool dataset's parameters; an ``image_size`` it takes but is not given is the run's image size."""
    raw = pool.dataset_params()
    fields = DATASETS.get(pool.name).params.model_fields
    images = len(splits.input_shape) == 3 and splits.train_x.dtype.is_floating_point
    if "image_size" in fields and "image_size" not in raw and images and splits.input_shape[1] == splits.input_shape[2]:
        raw["image_size"] = int(splits.input_shape[1])
    params = DATASETS.parse_params(pool.name, raw, "method.public")
    size = getattr(params, "image_size", None)
    if size is not None:
        if not images:
            raise ConfigError(f"method.public: dataset '{pool.name}' holds images and this run's model takes "
                              f"{tuple(splits.input_shape)} token ids; choose a text dataset as the public pool")
        if (size, size) != tuple(splits.input_shape[1:]):
            raise ConfigError(f"method.public.image_size {size} gives {size}x{size} images, the model takes "
                              f"{splits.input_shape[1]}x{splits.input_shape[2]}; set method.public.image_size: "
                              f"{splits.input_shape[1]} (or leave it out)")
    return params


def to_run_format(pool: DatasetSplits, splits: DatasetSplits, name: str, chunk: int = 1024) -> torch.Tensor:
    """The pool's training inputs as the run's model takes them (module docstring), or a ConfigError."""
    x = pool.train_x
    where = f"method.public: dataset '{name}'"
    if len(x) == 0:
        raise ConfigError(f"{where} has no training images; choose a dataset (or folder) that has some")
    if not splits.train_x.dtype.is_floating_point:  # token ids
        if x.dtype.is_floating_point or tuple(x.shape[1:]) != tuple(splits.input_shape):
            raise ConfigError(f"{where} holds {tuple(x.shape[1:])} {x.dtype} inputs, the model takes "
                              f"{tuple(splits.input_shape)} token ids; choose a text dataset of this length")
        if int(x.max()) >= splits.vocab_size:
            raise ConfigError(f"{where} has token ids up to {int(x.max())}, the model's vocabulary ends at "
                              f"{splits.vocab_size - 1}; use a pool tokenised with the run's vocabulary")
        return x
    channels, height, width = splits.input_shape
    if not x.dtype.is_floating_point or x.dim() != 4 or x.shape[1] not in (1, 3):
        raise ConfigError(f"{where} holds {tuple(x.shape[1:])} {x.dtype} inputs, the model takes "
                          f"[{channels}, {height}, {width}] images; choose an image dataset")
    if tuple(x.shape[2:]) != (height, width):
        raise ConfigError(f"{where} has {x.shape[3]}x{x.shape[2]} images, the model takes {width}x{height}; "
                          f"set method.public.image_size: {height}")
    if pool.pixel_stats is None or splits.pixel_stats is None:
        raise ConfigError(f"{where} or the run's data does not declare its pixel statistics "
                          "(DatasetSplits.pixel_stats), so the pool cannot be standardised like the run's data; "
                          "use sources that declare them")
    mean, std = (torch.as_tensor(v, dtype=torch.float32).reshape(1, -1, 1, 1) for v in splits.pixel_stats)
    out = torch.empty((len(x), channels, height, width), dtype=torch.float32)
    for lo in range(0, len(x), chunk):
        unit = pool.unit_images(x[lo: lo + chunk])
        if unit.shape[1] != channels:
            unit = unit.mean(1, keepdim=True) if channels == 1 else unit.expand(-1, channels, -1, -1)
        out[lo: lo + chunk] = (unit - mean) / std
    return out


@METHODS.register("feddf", params=FedDFParams)
class FedDF(OneShotMethod):
    """FedDF: one shot; FedAvg of the clients, then distillation of their ensemble on the public pool."""

    paper = "https://arxiv.org/abs/2006.07242"

    Params = FedDFParams

    def __init__(self, params: FedDFParams, run):
        super().__init__(params, run)
        pool = params.public
        # What the parameters alone show is refused now (also at --dry-run); the images at load time.
        self.source_params = public_source_params(pool, run.data.splits) if pool.source == "dataset" else None
        self._pool: Optional[torch.Tensor] = None

    def setup(self) -> None:
        pool = self.params.public
        if pool.source == "split":
            if len(self.run.data.public_indices) == 0:
                raise ConfigError("feddf distils the client models on the server's unlabeled public pool, and this "
                                  "config has none; set data.public_fraction (e.g. data.public_fraction=0.1), or "
                                  "method.public (e.g. {source: dataset, name: imagefolder, root: ...})")
            if self.params.progress:
                print("note: feddf distils on data.public_fraction of this run's own training set "
                      "(method.public.source: split), an offline stand-in for a separate public dataset "
                      "(FedCADO's tables: ImageNet)", file=sys.stderr, flush=True)
        super().setup()

    def public_inputs(self) -> torch.Tensor:
        """The unlabeled pool in the model's input format, loaded (and checked) once, on the server."""
        if self._pool is None:
            run, pool = self.run, self.params.public
            if pool.source == "split":
                self._pool = run.data.splits.train_x[torch.from_numpy(run.data.public_indices)]
            else:
                # checked here, on the server: in a deployment the clients need not hold the pool's folder
                root = getattr(self.source_params, "root", None)
                if root and not Path(root).expanduser().exists():
                    raise ConfigError(f"method.public.root {root} does not exist; point it at the public "
                                      "dataset's folder")
                loaded = DATASETS.get(pool.name).obj(self.source_params)
                self._pool = to_run_format(loaded, run.data.splits, pool.name)
        return self._pool

    def server_payload(self, round_, client_id, global_weights):
        if round_ == 1:
            self.public_inputs()  # a pool the model cannot take is refused before any client trains
        return super().server_payload(round_, client_id, global_weights)

    def one_shot(self, uploads):
        run, p = self.run, self.params
        teachers = self.teachers(uploads)
        own_arch = [u for u in uploads if self.arch_of(int(u["client_id"])).position < 0]
        start = (sample_weighted_average([u["weights"] for u in own_arch], [u["num_samples"] for u in own_arch])
                 if own_arch else None)
        student = self.fresh_global(start)
        x = self.public_inputs().to(run.device)  # moved once: the teachers and the student read it each step
        targets = mean_logit_targets([predict_logits(t, x) for t in teachers.values()], p.temperature)

        def batch_loss(model, idx):
            return distillation_loss(model(x[idx]), targets[idx], p.temperature)

        loss = fit(student, len(x), batch_loss, torch.optim.Adam(student.parameters(), lr=p.distill_lr),
                   p.distill_batch_size, server_generator(run.seed, 1), steps=p.distill_steps)
        self.stats.update({"public_images": int(len(x)), "distillation_loss": loss,
                           "fedavg_start_clients": len(own_arch)})
        return run.layout.flatten(student)
