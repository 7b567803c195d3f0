"""What a method may use during a run (server and client side of the in-process runtime)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from fedguide.config import Config
from fedguide.data.federated import FederatedData
from fedguide.fl.evaluation import Evaluator
from fedguide.fl.state import ClientStateStore
from fedguide.fl.weights import WeightLayout
from fedguide.models.split import SplitModel


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
