"""What a method sees: the run (``RunContext``, the same on the server and on every client of every
runtime, built by ``fl.setup.open_run``) and one client's round (``ClientContext``)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
from pydantic import BaseModel

from fedguide.config import ClientsConfig, Config, DataConfig, EvalConfig, GuidanceConfig, TrainConfig
from fedguide.core.evaluation import Evaluator
from fedguide.core.records import Record
from fedguide.core.state import ClientStateStore
from fedguide.core.weights import WeightLayout
from fedguide.data.federated import FederatedData
from fedguide.models.split import SplitModel

if TYPE_CHECKING:
    from fedguide.data.device_data import DeviceData
    from fedguide.data.federated import ClientData


@dataclass
class RunContext:
    """The run as its method and regularisers see it: the settings they read, the data, the one live model and
    the stores. ``config`` is the whole config for the engine and the runtimes; methods read the fields below
    it, so that what a method depends on is named here."""

    config: Config
    method_name: str  # the method's registered name (method.name), for messages and cache records
    seed: int
    train: TrainConfig
    eval: EvalConfig
    guidance: GuidanceConfig
    clients: ClientsConfig
    data_settings: DataConfig  # the data section (name, fraction, public pool); ``data`` is the data itself
    model_name: str  # the run's architecture (model.name) and its parsed parameters, method defaults applied
    model_params: BaseModel
    data: FederatedData
    model: SplitModel  # the one live model of this process
    make_model: Callable[[], SplitModel]  # a fresh model of the same architecture (e.g. a frozen teacher)
    layout: WeightLayout
    initial_weights: torch.Tensor
    evaluator: Evaluator
    store: ClientStateStore  # client-side state, one entry per client (lives with the client)
    server_store: ClientStateStore  # server-side memory per client (e.g. FedCDA's past models)
    run_dir: Path
    # Where this process computes (train.device); the model, the global weights, payloads and client state
    # in use live there. Tensors a method keeps (cached features, prototypes) belong there too.
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    # The training and test tensors where the batches are gathered (data.on_device), with train.augment.
    device_data: Optional["DeviceData"] = None

    @property
    def num_clients(self) -> int:
        return self.data.num_clients

    @property
    def num_classes(self) -> int:
        return self.data.num_classes


@dataclass
class ClientContext:
    """What a client sees during one round: its data, the server's payload, and its own state."""

    client_id: int
    round: int
    data: "ClientData"
    payload: Record
    state: dict[str, Any]
    state_dirty: bool = False
    steps: int = 0  # optimiser steps taken in this round's local training (set by ``Method.fit``)
    # Global sample indices of the batch ``local_loss`` is called with (per-sample cached features), on the host,
    # and the same indices where the run computes (None where the loop has no device data).
    batch_indices: Any = None
    batch_device_indices: Any = None
    # The client's random stream of this round, derived from (seed, round, client): batch order.
    generator: Optional[torch.Generator] = None
    # The run's tensors where it computes, which the local loop gathers its batches from (None: the host
    # tensors of ``data``).
    device_data: Optional["DeviceData"] = None

    @property
    def device(self) -> torch.device:
        return self.device_data.device if self.device_data is not None else torch.device("cpu")

    def batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, labels) of the training samples at host ``indices``, where the model is, without
        ``train.augment`` (for a method's own passes over the data, e.g. a full-batch gradient)."""
        if self.device_data is None:
            return self.data.x[indices], self.data.y[indices]
        return self.device_data.train_batch(self.device_data.indices(indices), augment=False)

    def update_state(self, **values: Any) -> None:
        self.state.update(values)
        self.state_dirty = True
