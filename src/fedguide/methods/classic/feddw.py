"""FedDW ("FedDW: Distilling Weights through Consistency Optimization in Heterogeneous Federated Learning"):
consistency between soft labels and classification-layer weights.

Client n, after local training, computes its soft-label (SL) matrix (Eq. 4–6):
    Ω_n[i, :] = mean over its training samples of class i of softmax(f(x)),
and uploads it with its per-class counts. The server aggregates per class over this round's uploads
(Eq. 7): Ω[i, :] = Σ_n (|D_i^n| / |D_i|) Ω_n[i, :]; a row of a class no uploader holds keeps its
previous value (Ω starts as the identity). Local objective (Eq. 11–12):
    L = L_cla + μ·L_reg,   L_reg = 1/C² · ‖Ω − softmax_rows(ω ωᵀ)‖_F²,
where ω ∈ R^{C×k} is the classification layer, which has no bias. L_reg depends on ω alone, so it
is evaluated once per batch (a C×C product), not per sample (Sec. IV-B). Weights: FedAvg (Eq. 8).

The regulariser ("dw") composes with any method (``regularizers: [dw]``: FedProx+DW, MOON+DW, …);
``method.name: feddw`` is FedAvg with it. Not reproduced from the released code: the cumulative
averaging of every past round's uploads (the paper aggregates this round's). Its decay of μ by 10
every 9 rounds is available as ``mu_decay_every: 9`` (off by default, as in the paper).

Model (Sec. V-A): "all datasets use two fully connected layers as the mapping layers f_π and one fully
connected layer as the classification layer f_ω. The size of vector passed to the classification layer
for all models is 128." The mapping layers belong to the comparison, so the config sets them for every
method compared (``model.mapping: [128, 128]`` in configs/feddw_fmnist.yaml and configs/paper/feddw_*; the
first layer's width is not stated, the released code's models.py has 256: ``model.mapping: [256, 128]``).
What FedDW itself needs, the bias-free classification layer, is a requirement (``model_requirements``): a
config without ``model.head_bias: false`` is refused with that key named, for ``feddw`` and for the ``dw``
regulariser on any other method; nothing about the network is changed by the method's name.
"""
from __future__ import annotations

from typing import Optional

import torch
from pydantic import BaseModel, ConfigDict, Field

from fedguide.methods.base import METHODS
from fedguide.methods.compose import REGULARIZERS, Regularizer
from fedguide.methods.classic.fedavg import FedAvg


class DWParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    mu: float = Field(0.1, ge=0.0, description="weight of L_reg (paper: 0.1 CIFAR-10, 10 CIFAR-100)")
    mu_decay_every: Optional[int] = Field(None, ge=1, description="released code: divide mu every k rounds")
    mu_decay_factor: float = Field(10.0, gt=0.0)


def class_relation(omega: torch.Tensor) -> torch.Tensor:
    """CR matrix softmax_rows(ω ωᵀ): class-to-class similarity as the classification layer sees it."""
    return torch.softmax(omega @ omega.t(), dim=1)


def dw_loss(sl_global: torch.Tensor, omega: torch.Tensor) -> torch.Tensor:
    """Eq. 11: 1/C² · ‖Ω_global − softmax_rows(ω ωᵀ)‖_F²."""
    c = sl_global.shape[0]
    return (sl_global - class_relation(omega)).square().sum() / (c * c)


@torch.no_grad()
def soft_label_matrix(probs: torch.Tensor, labels: torch.Tensor, num_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. 4: per-class mean of softmax outputs; rows of absent classes are zero. Returns (Ω_n, counts)."""
    counts = torch.bincount(labels, minlength=num_classes)
    sums = torch.zeros(num_classes, probs.shape[1], dtype=probs.dtype, device=probs.device).index_add_(0, labels, probs)
    return sums / counts.clamp(min=1).unsqueeze(1).to(probs.dtype), counts


def aggregate_soft_labels(previous: torch.Tensor, matrices: list[torch.Tensor], counts: list[torch.Tensor]) -> torch.Tensor:
    """Eq. 7 over this round's uploads; rows nobody holds keep their previous value."""
    n = torch.stack(counts).to(torch.float64)  # [K, C]
    total = n.sum(0)
    weighted = (torch.stack(matrices).to(torch.float64) * n.unsqueeze(2)).sum(0)
    out = previous.to(torch.float64).clone()
    seen = total > 0
    out[seen] = weighted[seen] / total[seen].unsqueeze(1)
    return out.to(previous.dtype)


def mu_at(params: DWParams, round_: int) -> float:
    if params.mu_decay_every is None:
        return params.mu
    return params.mu / params.mu_decay_factor ** ((round_ - 1) // params.mu_decay_every)


@REGULARIZERS.register("dw", params=DWParams, summary="FedDW: soft labels vs classification-layer relations")
class DW(Regularizer):
    """FedDW's regulariser μ·L_reg with the soft-label matrix as its server state."""

    name = "dw"
    # Sec. III: the classification layer ω has no bias (L_reg relates its rows alone). The released code
    # (liuvvvvv1/FedDW models.py, fc3 = nn.Linear(128, ...), lines 59 and 208) keeps a bias for every method,
    # FedDW included; fedguide follows the paper.
    model_requirements = {"head_bias": False}

    def __init__(self, params, run):
        super().__init__(params, run)
        self.sl = torch.eye(run.num_classes, device=run.device)  # Ω_0 = I, where the server aggregates

    def server_payload(self, round_, client_id):
        return {"sl": self.sl}

    def loss(self, model, x, y, ctx, payload):
        mu = mu_at(self.params, ctx.round)
        if mu == 0:
            return torch.zeros((), device=ctx.device)
        return mu * dw_loss(payload["sl"], model.head.weight)

    def client_upload(self, model, ctx, payload):
        data = ctx.data
        was_training = model.training
        model.eval()
        probs, labels = [], []
        with torch.no_grad():
            for start in range(0, len(data), 1024):  # the client's data where the model is (ctx.batch)
                x, y = ctx.batch(data.indices[start: start + 1024])
                probs.append(torch.softmax(model(x), dim=1))
                labels.append(y)
        model.train(was_training)
        sl, counts = soft_label_matrix(torch.cat(probs), torch.cat(labels), data.num_classes)
        return {"sl": sl, "counts": counts}

    def aggregate(self, round_, uploads):
        self.sl = aggregate_soft_labels(self.sl, [u["sl"] for u in uploads], [u["counts"] for u in uploads])

    def server_state(self):
        return {"sl": self.sl}

    def load_server_state(self, state):
        self.sl = state["sl"]


@METHODS.register("feddw", params=DWParams)
class FedDW(FedAvg):
    """FedDW: FedAvg + μ·‖Ω_global − softmax(ωωᵀ)‖²/C² (bias-free head; soft-label matrices aggregated)."""

    paper = "https://arxiv.org/abs/2412.04521"

    # The mapping layers of Sec. V-A are given to every model of the paper's comparison, so the config sets
    # them (configs/paper/feddw_*); only the bias-free head is FedDW's own need.
    model_requirements = DW.model_requirements

    def __init__(self, params, run):
        super().__init__(params, run)
        # The method is FedAvg trained with the regulariser, exactly as fedavg with regularizers: [dw].
        self.regularizers = [DW(params, run)]
