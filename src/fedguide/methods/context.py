"""What a method sees: the run (``RunContext``, the same on the server and on every client of every
runtime, built by ``fl.setup.open_run``) and one client's round (``ClientContext``)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from fedguide.config import Config
from fedguide.core.evaluation import Evaluator
from fedguide.core.records import Record
from fedguide.core.state import ClientStateStore
from fedguide.core.weights import WeightLayout
from fedguide.data.federated import FederatedData
from fedguide.models.split import SplitModel

if TYPE_CHECKING:
    from fedguide.data.federated import ClientData


@dataclass
class RunContext:
    config: Config
    data: FederatedData
    model: SplitModel  # the one live model of this process
    make_model: Callable[[], SplitModel]  # a fresh model of the same architecture (e.g. a frozen teacher)
    layout: WeightLayout
    initial_weights: torch.Tensor
    evaluator: Evaluator
    store: ClientStateStore  # client-side state, one entry per client (lives with the client)
    server_store: ClientStateStore  # server-side memory per client (e.g. FedCDA's past models)
    run_dir: Path

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
    scratch: dict[str, Any] = field(default_factory=dict)  # per-round, never persisted
    state_dirty: bool = False
    steps: int = 0  # optimiser steps taken in this round's local training (set by ``Method.fit``)
    # Global sample indices of the batch ``local_loss`` is called with (per-sample cached features).
    batch_indices: Any = None
    # The client's random stream of this round, derived from (seed, round, client): batch order.
    generator: Optional[torch.Generator] = None

    def update_state(self, **values: Any) -> None:
        self.state.update(values)
        self.state_dirty = True
