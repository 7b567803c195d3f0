"""The Method interface: a few hooks around a fixed round loop (in the spirit of Flower's Strategy).

A method overrides only what differs from FedAvg. Server-side hooks: ``setup``, ``server_payload``,
``aggregate``, ``evaluate``; client-side hooks: ``client_start``, ``begin_local``, ``local_loss``,
``client_upload``. Payloads and uploads are plain records (dicts of tensors and scalars) so the same
method runs in-process and across a network.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import BaseModel

from fedguide.fl.aggregation import sample_weighted_average
from fedguide.registry import NoParams, Registry

if TYPE_CHECKING:
    from fedguide.config import TrainConfig
    from fedguide.data.federated import ClientData
    from fedguide.fl.context import RunContext
    from fedguide.models.split import SplitModel

Record = dict[str, Any]


def record_bytes(record: Record) -> int:
    """Bytes a record occupies on the wire: tensor payloads, plus 8 bytes per scalar."""
    total = 0
    for v in record.values():
        if isinstance(v, torch.Tensor):
            total += v.numel() * v.element_size()
        elif isinstance(v, dict):
            total += record_bytes(v)
        else:
            total += 8
    return total


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
    steps: int = 0  # optimiser steps taken in this round's local training (set after training)
    # Global sample indices of the batch ``local_loss`` is called with (per-sample cached features).
    batch_indices: Any = None
    train_loss: float = float("nan")

    def update_state(self, **values: Any) -> None:
        self.state.update(values)
        self.state_dirty = True


class Method:
    """FedAvg's behaviour; subclasses override hooks. Registered via ``@METHODS.register(name)``."""

    Params: ClassVar[type[BaseModel]] = NoParams
    # Model keys this method's paper fixes (e.g. FedDW's bias-free head); a config's explicit keys win.
    model_defaults: ClassVar[dict[str, Any]] = {}
    # False for methods that learn from unlabeled clients (semi-supervised scenarios, FedDISC).
    needs_client_labels: ClassVar[bool] = True

    def __init__(self, params: BaseModel, run: "RunContext"):
        self.params = params
        self.run = run

    # ---- federation ---------------------------------------------------------------------------
    @staticmethod
    def federation(client_indices: list[np.ndarray]) -> list[np.ndarray]:
        """Reshape the partition before training (Centralized merges every client into one)."""
        return client_indices

    def setup(self) -> None:
        """On the server before the first round of this process (also on resume): fit bases,
        precompute features, build prototypes. Server state that evolves goes in ``server_state``."""

    def init_global(self, weights: torch.Tensor) -> torch.Tensor:
        """The round-1 global weights (a fresh run only), e.g. FedNH's fixed prototype head."""
        return weights

    # ---- server -> client ---------------------------------------------------------------------
    def server_payload(self, round_: int, client_id: int, global_weights: torch.Tensor) -> Record:
        return {"weights": global_weights}

    # ---- client -------------------------------------------------------------------------------
    def local_train(self, train: "TrainConfig") -> "TrainConfig":
        """The settings of this method's local loop (SCAFFOLD's Algorithm 1 is plain SGD)."""
        return train

    def client_start(self, ctx: ClientContext) -> torch.Tensor:
        """The weights local training starts from."""
        return ctx.payload["weights"]

    def begin_local(self, model: "SplitModel", ctx: ClientContext) -> None:
        """After the start weights are loaded, before the first step (cache anchors in ctx.scratch)."""

    def local_loss(self, model: "SplitModel", x: torch.Tensor, y: torch.Tensor, ctx: ClientContext) -> torch.Tensor:
        return F.cross_entropy(model(x), y)

    def after_backward(self, model: "SplitModel", ctx: ClientContext) -> None:
        """Between backward and the optimiser step: edit gradients in place (a closed-form term's
        gradient is cheaper added here than traced by autograd)."""

    def client_upload(self, model: "SplitModel", ctx: ClientContext) -> Record:
        return {"weights": self.run.layout.flatten(model), "num_samples": len(ctx.data)}

    # ---- server -------------------------------------------------------------------------------
    def aggregate(self, round_: int, global_weights: torch.Tensor, uploads: list[Record]) -> torch.Tensor:
        return sample_weighted_average([u["weights"] for u in uploads], [u["num_samples"] for u in uploads])

    def evaluate(self, round_: int, global_weights: torch.Tensor) -> dict[str, Any]:
        """Test metrics of this round; must contain ``accuracy``."""
        return self.run.evaluator.evaluate(global_weights)

    # ---- checkpointing of server-side state -------------------------------------------------------
    def server_state(self) -> dict[str, torch.Tensor]:
        return {}

    def load_server_state(self, state: dict[str, torch.Tensor]) -> None:
        if state:
            raise ValueError(f"{type(self).__name__} keeps no server state but the checkpoint has {sorted(state)}")


METHODS: Registry = Registry("method")
