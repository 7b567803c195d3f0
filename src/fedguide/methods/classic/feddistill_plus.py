"""FedDistill+ (FedDW's Table IV baseline): federated distillation with global per-class logits (Jeong et
al. 2018, "Communication-efficient on-device machine learning: federated distillation and augmentation",
FedDW's [17]) plus the global aggregation of the whole network, which FedDW adds ("FedDistill+ adds the
entire network global aggregation on the basis of [17]").

Client k, while it trains, keeps the mean of the logits its model produced for the samples of each class c
(over every step of the round): F_k[c] = mean of f(x) over the round's training batches' samples of class
c. It uploads F_k, its per-class sample counts and its weights. The server aggregates the per-class logits
over the round's uploaders that hold the class,
    F[c] = 1/|K_c| · Σ_{k∈K_c} F_k[c],          K_c = the uploaders with samples of c,
and the weights by FedAvg. Local objective with the received F:
    L = CE(f(x), y) + λ · 1/(B·C) · Σ_{i: F[y_i] known} ‖f(x_i) − F[y_i]‖²,
the mean squared error of the logits against the global logits of their label (samples of a class without
a global logit add no term but count in the mean).

Sources and decisions:
- The released code of the FedDW authors is not at hand; the form above is PFLlib's FedDistill (clientdistill.py,
  serverdistill.py), the implementation the FedDW paper's other personalised baselines come from: logits
  collected during training, MSE with weight λ (``lam``, PFLlib's default 1.0), per-class means averaged
  over the clients unweighted, and the global logits replaced every round (classes no uploader held
  this round have none: ``absent_classes: drop``). ``absent_classes: keep`` keeps a class's last global
  logits instead; ``class_weighting: samples`` weights the clients' per-class means by their counts.
- Round 1 (no global logits yet) is plain cross-entropy.
- Global accuracy: the averaged model on the global test set (FedAvg's).

``regularizers: [dw]`` composes FedDW's term with it (FedDistill++DW, FedDW Table IV): the local loop is
the run's, so the composed loss is this one plus μ·L_reg.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field

from fedguide.methods.base import METHODS, Method


class FedDistillPlusParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lam: float = Field(1.0, ge=0.0, description="weight λ of the logit distillation term (PFLlib default 1.0)")
    class_weighting: Literal["clients", "samples"] = Field(
        "clients", description="global logit of a class: plain mean over the clients holding it, or sample-weighted")
    absent_classes: Literal["drop", "keep"] = Field(
        "drop", description="classes no uploader held this round: no global logit (drop) or the last one (keep)")


def distill_term(logits: torch.Tensor, labels: torch.Tensor, class_logits: torch.Tensor,
                 known: torch.Tensor) -> torch.Tensor:
    """1/(B·C) · Σ_{i: known[y_i]} ‖logits_i − class_logits[y_i]‖² (nn.MSELoss over the whole batch, with
    the samples of unknown classes matching themselves)."""
    target = class_logits.to(logits.device, logits.dtype)[labels]
    mask = known.to(logits.device)[labels].unsqueeze(1)
    diff = (logits - target).masked_fill(~mask, 0.0)
    return diff.square().sum() / logits.numel()


def aggregate_class_logits(previous: torch.Tensor, previous_known: torch.Tensor, means: list[torch.Tensor],
                           counts: list[torch.Tensor], weighting: str = "clients",
                           absent: str = "drop") -> tuple[torch.Tensor, torch.Tensor]:
    """(F, known) from the uploaders' per-class means [C, C] and counts [C] (module docstring)."""
    n = torch.stack(counts).to(torch.float64)  # [K, C]
    w = n if weighting == "samples" else (n > 0).to(torch.float64)
    total = w.sum(0)
    seen = total > 0
    summed = (torch.stack(means).to(torch.float64) * w.unsqueeze(2)).sum(0)
    out = previous.to(torch.float64).clone() if absent == "keep" else torch.zeros_like(summed)
    out[seen] = summed[seen] / total[seen].unsqueeze(1)
    known = (previous_known | seen) if absent == "keep" else seen
    return out.to(previous.dtype), known


@dataclass
class DistillRound:
    """A client's round: its logits summed per label (for the upload) and whether the distillation term is on."""

    logit_sums: torch.Tensor  # [C, C]
    logit_counts: torch.Tensor  # [C]
    distill: bool


@METHODS.register("feddistill_plus", params=FedDistillPlusParams)
class FedDistillPlus(Method):
    """FedDistill+: CE + λ·MSE(logits, global per-class logits of the label), logits and weights averaged."""

    def __init__(self, params, run):
        super().__init__(params, run)
        c = run.num_classes
        self.class_logits = torch.zeros(c, c, device=run.device)
        self.known = torch.zeros(c, dtype=torch.bool, device=run.device)

    def server_payload(self, round_, client_id, global_weights):
        return {"weights": global_weights, "class_logits": self.class_logits, "class_known": self.known}

    def begin_local(self, model, ctx):
        c = self.run.num_classes
        device = ctx.payload["weights"].device
        # Asked once per round, not per step: whether any class has a global logit yet (round 1: none).
        return DistillRound(torch.zeros(c, c, device=device), torch.zeros(c, device=device),
                            bool(self.params.lam) and bool(ctx.payload["class_known"].any()))

    def local_loss(self, model, x, y, ctx, state: DistillRound):
        logits = model(x)
        with torch.no_grad():
            state.logit_sums.index_add_(0, y, logits.detach().float())
            state.logit_counts.index_add_(0, y, torch.ones_like(y, dtype=torch.float32))
        loss = F.cross_entropy(logits, y)
        if state.distill:
            loss = loss + self.params.lam * distill_term(logits, y, ctx.payload["class_logits"],
                                                         ctx.payload["class_known"])
        return loss

    def client_upload(self, model, ctx, state: DistillRound):
        sums, counts = state.logit_sums, state.logit_counts
        means = sums / counts.clamp(min=1).unsqueeze(1)
        return {**super().client_upload(model, ctx, state), "class_logits": means, "class_counts": counts}

    def aggregate(self, round_, global_weights, uploads):
        p = self.params
        self.class_logits, self.known = aggregate_class_logits(
            self.class_logits, self.known, [u["class_logits"] for u in uploads], [u["class_counts"] for u in uploads],
            p.class_weighting, p.absent_classes)
        return super().aggregate(round_, global_weights, uploads)

    def server_state(self):
        return {"class_logits": self.class_logits, "class_known": self.known}

    def load_server_state(self, state):
        self.class_logits, self.known = state["class_logits"], state["class_known"].bool()
