"""What the one-shot methods (FedCADO, SD_Gen, FedDF) share: clients that train once, to convergence, each
with its own architecture if the config says so, and a server that builds the global model from their
uploads in a single round.

Round structure. Round 1 is the one shot: every client trains its classifier from a common seeded
initialisation for ``local_epochs`` epochs (paper: 20, lr 0.01; the optimiser, lr and batch size are
the ``train`` section's) and uploads it once, with the set of classes it holds; the server builds the
global model (the method's ``one_shot``) from the clients the engine samples for round 1 (all of them
unless ``clients.per_round`` < ``clients.num``; an unsampled client never contributes). Later rounds,
when ``train.rounds`` > 1, are idle: nothing is sent either way, clients do not train, the global model
stays as it is, so the accuracy curve is flat after round 1. Allowing them (rather than refusing the
config) lets a one-shot method run under any shared config; a note on stderr says so.

Decisions:

- Why ``local_epochs`` and not ``train.epochs``: a benchmark suite runs the one-shot methods next to
  multi-round ones (FedAvg, 20 rounds of a few epochs) from one config; the one-shot clients' "train to
  convergence" is the method's own setting.
- Uploads: ``{"weights": the client's whole state as one float32 vector (WeightLayout of its own
  architecture: parameters and buffers, so BatchNorm running means and variances travel),
  "num_samples", "classes": float mask [C] of the classes it holds at least min_class_samples of}``.
  The server rebuilds each client's architecture from the config (client k has entry k mod n of
  ``client_models``) to read its vector, so no architecture description travels. Nothing is sent to
  the clients: their common initialisation is seeded, which needs no communication.
- Heterogeneous architectures (``client_models``): an entry equal to the config's model (same name
  and parameters) starts from the run's initial weights, the global model's own initialisation;
  another architecture from the seed derived from (run seed, its position in the list).
- Where the clients train: ``fit`` trains a model of the client's own architecture with the default
  local loop (``core.training.train_local``, plain cross-entropy) in round 1; the run's live model
  takes no step. This keeps both heterogeneous clients and "train in round 1 only" inside the Method
  interface. The round's reported train loss is the mean loss of the clients' convergence training
  (null where no client trained: idle rounds, SD_Gen without teachers).
- Server-side randomness (the global model's training order) comes from streams derived from the run
  seed (``server_generator``), like every other stream of a run.
- Metrics of round 1 add what the server did (images generated, images/s, ...), the mean test
  accuracy of the uploaded client models and, when the clients' class sets differ (label skew), each
  client's classes' accuracy of the global model (``client_class_accuracy``, the paper's per-client
  columns of Table 2); per-domain accuracy comes from the evaluator where the data has domains.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from fedguide.core.evaluation import Evaluator, class_set_accuracy
from fedguide.core.seeding import derive_seed, torch_generator
from fedguide.core.training import train_local
from fedguide.core.weights import WeightLayout
from fedguide.methods.base import Method
from fedguide.models import MODELS, build_model
from fedguide.models.split import SplitModel
from fedguide.registry import ConfigError, NoParams

ModelEntry = Union[str, dict[str, Any]]
SERVER_STREAM = 1_000_000  # "model" seed keys from here on are the server's own streams


def parse_entry(entry: Any, where: str) -> tuple[str, BaseModel]:
    """A ``client_models`` entry (a model name, or {name: ..., <its params>}) -> (name, parsed params)."""
    if isinstance(entry, str):
        name, raw = entry, {}
    elif isinstance(entry, dict) and isinstance(entry.get("name"), str):
        raw = {k: v for k, v in entry.items() if k != "name"}
        name = entry["name"]
    else:
        raise ConfigError(f"{where} must be a model name or {{name: <model>, <params>}}, got {entry!r}")
    return name, MODELS.parse_params(name, raw, where)


class OneShotParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    local_epochs: int = Field(20, ge=1, description="epochs each client trains its classifier for, once "
                                                    "(paper: 20, to convergence); lr, optimiser, batch size: train.*")
    client_models: list[ModelEntry] = Field(
        default_factory=list, description="client architectures, cycled over the clients (client k gets entry "
                                          "k mod n): a model name or {name: <model>, <params>}; empty = every "
                                          "client uses the config's model")
    min_class_samples: int = Field(1, ge=1, description="a client supports a class when it holds at least "
                                                        "this many samples of it")
    progress: bool = Field(True, description="progress bars and per-client lines on stderr during server work")
    client_eval: bool = Field(True, description="also report the uploaded client models' mean test accuracy "
                                                "(one test-set pass per client model)")

    @field_validator("client_models")
    @classmethod
    def _known_models(cls, entries: list[ModelEntry]) -> list[ModelEntry]:
        for i, entry in enumerate(entries):
            parse_entry(entry, f"method.client_models[{i}]")
        return entries


@dataclass(frozen=True)
class Architecture:
    name: str
    params: BaseModel
    position: int  # index in client_models; -1 = the config's own model (the global architecture)

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, **self.params.model_dump(mode="json")}


def supported_mask(class_counts: torch.Tensor, min_samples: int) -> torch.Tensor:
    return (class_counts >= min_samples).to(torch.float32)


def classes_of(mask: torch.Tensor) -> list[int]:
    return [int(c) for c in torch.nonzero(mask > 0.5).flatten().tolist()]


def server_generator(seed: int, key: int) -> torch.Generator:
    return torch_generator(seed, "model", SERVER_STREAM + key)


def frozen(model: SplitModel) -> SplitModel:
    model.eval()
    model.requires_grad_(False)
    return model


class OneShotMethod(Method):
    """Clients train once and upload their whole model; ``one_shot`` builds the global model in round 1."""

    # Uploads and server state stay on the host (whole client models, one round); the models compute on
    # the run's device: client training with the device batches, teachers and students on the server.
    on_device = False
    Params = OneShotParams

    def __init__(self, params: OneShotParams, run):
        super().__init__(params, run)
        self.spec = run.data.splits.model_spec()
        self.global_arch = Architecture(run.model_name, run.model_params, -1)
        self.archs = [self._architecture(i, entry) for i, entry in enumerate(params.client_models)]
        for arch in self.archs:
            if arch.position >= 0:
                try:  # an architecture that cannot take these inputs is a config error, found at once
                    with torch.random.fork_rng(devices=[]):
                        build_model(arch.name, arch.params, self.spec)
                except ValueError as err:
                    raise ConfigError(f"method.client_models[{arch.position}]: {err}") from None
        self.stats: dict[str, Any] = {}
        self.client_classes: dict[int, list[int]] = {}

    def _architecture(self, position: int, entry: ModelEntry) -> Architecture:
        name, params = parse_entry(entry, f"method.client_models[{position}]")
        same = name == self.global_arch.name and params.model_dump() == self.global_arch.params.model_dump()
        return Architecture(name, params, -1 if same else position)

    # ---- what a subclass decides -------------------------------------------------------------------
    @property
    def clients_train(self) -> bool:
        """Whether the server needs the client models (SD_Gen fine-tuning does not)."""
        return True

    def one_shot(self, uploads: list[dict[str, Any]]) -> torch.Tensor:
        """The global weights from the round-1 uploads (sorted by client id); may fill ``self.stats``."""
        raise NotImplementedError

    def setup(self) -> None:
        if self.run.train.rounds > 1 and self.params.progress:
            print(f"note: {self.run.method_name} is one-shot: round 1 builds the global model, rounds 2-"
                  f"{self.run.train.rounds} are idle (set train.rounds: 1)", file=sys.stderr, flush=True)

    # ---- architectures -----------------------------------------------------------------------------
    def arch_of(self, client_id: int) -> Architecture:
        return self.archs[client_id % len(self.archs)] if self.archs else self.global_arch

    def build_client_model(self, client_id: int) -> SplitModel:
        """Client ``client_id``'s architecture at its seeded initialisation (global RNG untouched)."""
        arch = self.arch_of(client_id)
        with torch.random.fork_rng(devices=[]):
            if arch.position < 0:
                model = self.run.make_model()
                self.run.layout.load(model, self.run.initial_weights)
            else:
                torch.manual_seed(derive_seed(self.run.seed, "model", arch.position + 1))
                # drawn on the host, then moved: the same initialisation on every device (as run.make_model)
                model = build_model(arch.name, arch.params, self.spec).to(self.run.device)
        return model

    def fresh_global(self, weights: Optional[torch.Tensor] = None) -> SplitModel:
        with torch.random.fork_rng(devices=[]):
            model = self.run.make_model()
        self.run.layout.load(model, self.run.initial_weights if weights is None else weights)
        return model

    # ---- client side -------------------------------------------------------------------------------
    def server_payload(self, round_, client_id, global_weights):
        return {}

    def client_start(self, ctx):
        return self.run.initial_weights  # the live model's start; it takes no step (fit)

    def fit(self, model, ctx, train):
        # Each client trains its own (possibly other) architecture with the local loop; the run's live
        # model takes no step. The round's state is the client's own trained model (None: it trains none).
        if ctx.round != 1 or not self.clients_train:
            return None, None
        own = self.build_client_model(ctx.client_id)
        train = train.model_copy(update={"epochs": self.params.local_epochs, "local_steps": None})
        loss, _ = train_local(own, Method(NoParams(), self.run), ctx, train, ctx.generator)
        return loss, own

    def client_upload(self, model, ctx, state: Optional[SplitModel]):
        upload: dict[str, Any] = {"num_samples": len(ctx.data)}
        if ctx.round != 1:
            return upload
        upload["classes"] = supported_mask(ctx.data.class_counts(), self.params.min_class_samples)
        if state is not None:
            upload["weights"] = WeightLayout.of(state).flatten(state)
        return upload

    # ---- server side -------------------------------------------------------------------------------
    def aggregate(self, round_, global_weights, uploads):
        if round_ != 1:
            return global_weights
        uploads = sorted(uploads, key=lambda u: u["client_id"])
        self.client_classes = {int(u["client_id"]): classes_of(u["classes"]) for u in uploads}
        return self.one_shot(uploads)

    def teacher(self, upload: dict[str, Any]) -> SplitModel:
        """The uploaded client model, rebuilt in its architecture, frozen in eval mode."""
        cid = int(upload["client_id"])
        if "weights" not in upload:
            raise ConfigError(f"client {cid} uploaded no model; this method's server needs the client models")
        model = self.build_client_model(cid)
        try:
            WeightLayout.of(model).load(model, upload["weights"])
        except ValueError as err:
            raise ConfigError(f"client {cid}'s upload does not fit its architecture {self.arch_of(cid).name}: "
                              f"{err}; the config's client_models changed since the clients trained") from None
        return frozen(model)

    def teachers(self, uploads: list[dict[str, Any]]) -> dict[int, SplitModel]:
        teachers = {int(u["client_id"]): self.teacher(u) for u in uploads}
        if self.params.client_eval and teachers:
            splits = self.run.data.splits
            accs = []
            for m in teachers.values():
                layout = WeightLayout.of(m)
                evaluator = Evaluator(m, layout, splits.test_x, splits.test_y, self.run.train.eval_batch_size,
                                      device_data=self.run.device_data)
                accs.append(evaluator.evaluate(layout.flatten(m))["accuracy"])
                frozen(m)  # evaluate() loads the weights in place; keep the model frozen
            self.stats["client_models_accuracy_mean"] = float(sum(accs) / len(accs))
        return teachers

    def evaluate(self, round_, global_weights):
        if round_ != 1:
            return self.run.evaluator.evaluate(global_weights)
        # One pass over the test set gives the usual metrics and the per-client ones.
        _, logits, _ = self.run.evaluator.features(global_weights)
        predictions, y = logits.argmax(1).cpu(), self.run.evaluator.y  # scored on the host, as score() does
        out = self.run.evaluator.score(predictions, logits)
        out.update(self.stats)
        out.update(client_class_accuracy(predictions, y, self.client_classes))
        return out


def client_class_accuracy(predictions: torch.Tensor, labels: torch.Tensor,
                          client_classes: dict[int, list[int]]) -> dict[str, Any]:
    """Accuracy on each client's classes (``client_class_accuracy``), when the clients' class sets differ."""
    sets = list(client_classes.values())
    if len(sets) < 2 or all(s == sets[0] for s in sets):
        return {}
    return {"client_class_accuracy": class_set_accuracy(predictions == labels, labels, client_classes)}
