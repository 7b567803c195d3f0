"""FedDistill+ (FedDW's Table IV baseline): federated distillation with global per-class outputs (Jeong et
al. 2018, "Communication-efficient on-device machine learning: federated distillation and augmentation",
FedDW's [17]) plus the global aggregation of the whole network, which FedDW adds ("FedDistill+ adds the
entire network global aggregation on the basis of [17]").

``form: released`` (the default) is FedDistill+ as the FedDW authors' code runs it, the source of Table IV's
FedDistill+ and FedDistill++DW rows (liuvvvvv1/FedDW: Updata.py, ``Local_Update_by_FedDistill``, lines
194-257; main.py, the ``'FedDistill+'`` branch, lines 178-238):
- targets T ∈ R^{C×C} start as the identity (main.py line 180), so round 1 already distils to one-hot rows;
- client k trains on CE(f(x), y) + λ·term(softmax f(x), T[y]) (Updata.py lines 214-229, λ = 1 there);
- after training, in eval mode over its whole set, it sums softmax f(x) per label and counts the labels
  (lines 237-257) and uploads both with its weights;
- the server keeps the sums and counts of *every* upload so far (``client_distill`` is never cleared, main.py
  lines 183-201, 219-226), gives a class nobody has held the identity row with count 1 (lines 228-233), and
  blends: T[c] ← 0.5 · S[c]/N[c] + 0.5 · T[c] (line 237; ``blend``).
The released term (``loss: released``) is ``nn.KLDivLoss(reduction='batchmean')(p, T[y])`` with the
*probabilities* p as its input where PyTorch expects log-probabilities: it computes
    1/B · Σ_i Σ_c T[y_i]_c · (log T[y_i]_c − p_ic)      (0·log 0 = 0),
a term linear in p whose gradient, −T[y_i]/B, raises the probability of the classes the target holds, not a
divergence. ``loss: kl`` is the divergence it meant, 1/B · Σ_i KL(T[y_i] ‖ p_i); ``loss: mse`` is
nn.MSELoss(p, T[y]) over the B·C entries.

``form: pfllib`` is PFLlib's FedDistill (clientdistill.py, serverdistill.py), which fedguide followed before
the released code was read: the mean logits of each class collected during training, MSE against the global
logits with weight λ, per-class means averaged over the round's uploaders holding the class (unweighted,
``class_weighting: samples`` to weight by counts), classes no uploader held this round dropped
(``absent_classes: keep`` keeps their last value); round 1 (no global logits yet) is plain cross-entropy:
    L = CE(f(x), y) + λ · 1/(B·C) · Σ_{i: F[y_i] known} ‖f(x_i) − F[y_i]‖².

Global accuracy: the averaged model on the global test set (FedAvg's). ``regularizers: [dw]`` composes
FedDW's term with it (FedDistill++DW, FedDW Table IV): the local loop is the run's, so the composed loss is
this one plus μ·L_reg.
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
    form: Literal["released", "pfllib"] = Field(
        "released", description="released = the FedDW authors' code (Table IV); pfllib = PFLlib's FedDistill")
    lam: float = Field(1.0, ge=0.0, description="weight λ of the distillation term (1 in both sources)")
    loss: Literal["released", "kl", "mse"] = Field(
        "released", description="form released: the released KLDivLoss on probabilities (a linear term), a true "
                                "KL divergence, or MSE of the probabilities")
    blend: float = Field(0.5, ge=0.0, le=1.0, description="form released: weight of the new cumulative average "
                                                          "in the targets (released: 0.5)")
    class_weighting: Literal["clients", "samples"] = Field(
        "clients", description="form pfllib: global logit of a class, plain mean over the clients holding it or "
                               "sample-weighted")
    absent_classes: Literal["drop", "keep"] = Field(
        "drop", description="form pfllib: classes no uploader held this round, no global logit (drop) or the "
                            "last one (keep)")


def distill_term(logits: torch.Tensor, labels: torch.Tensor, class_logits: torch.Tensor,
                 known: torch.Tensor) -> torch.Tensor:
    """1/(B·C) · Σ_{i: known[y_i]} ‖logits_i − class_logits[y_i]‖² (nn.MSELoss over the whole batch, with
    the samples of unknown classes matching themselves)."""
    target = class_logits.to(logits.device, logits.dtype)[labels]
    mask = known.to(logits.device)[labels].unsqueeze(1)
    diff = (logits - target).masked_fill(~mask, 0.0)
    return diff.square().sum() / logits.numel()


def released_term(probs: torch.Tensor, targets: torch.Tensor, loss: str = "released") -> torch.Tensor:
    """The released local term on the probabilities p [B, C] against their labels' targets [B, C] (module
    docstring): ``released`` = KLDivLoss(batchmean)(p, t) = Σ t·(log t − p)/B; ``kl`` = Σ t·(log t − log p)/B;
    ``mse`` = mean of (p − t)²."""
    if loss == "mse":
        return F.mse_loss(probs, targets)
    second = probs if loss == "released" else torch.log(probs.clamp_min(torch.finfo(probs.dtype).tiny))
    return (torch.xlogy(targets, targets) - targets * second).sum() / probs.shape[0]


def aggregate_released(targets: torch.Tensor, sums: torch.Tensor, counts: torch.Tensor, blend: float = 0.5
                       ) -> torch.Tensor:
    """T ← blend · S/N + (1 − blend) · T from the cumulative per-class probability sums S [C, C] and counts N
    [C] of every upload so far; a class nobody has held counts as its identity row (main.py lines 228-237)."""
    eye = torch.eye(len(counts), dtype=torch.float64, device=sums.device)
    absent = counts == 0
    s = torch.where(absent.unsqueeze(1), sums.to(torch.float64) + eye, sums.to(torch.float64))
    n = torch.where(absent, torch.ones_like(counts, dtype=torch.float64), counts.to(torch.float64))
    return (blend * s / n.unsqueeze(1) + (1 - blend) * targets.to(torch.float64)).to(targets.dtype)


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
    """A client's round (form pfllib): its logits summed per label (for the upload) and whether the
    distillation term is on."""

    logit_sums: torch.Tensor  # [C, C]
    logit_counts: torch.Tensor  # [C]
    distill: bool


@METHODS.register("feddistill_plus", params=FedDistillPlusParams)
class FedDistillPlus(Method):
    """FedDistill+: CE + λ·term against global per-class targets, the targets and the weights aggregated."""

    paper = "https://arxiv.org/abs/1811.11479"

    def __init__(self, params, run):
        super().__init__(params, run)
        c = run.num_classes
        if params.form == "released":
            self.targets = torch.eye(c, device=run.device)
            self.prob_sums = torch.zeros(c, c, dtype=torch.float64, device=run.device)  # every upload so far
            self.prob_counts = torch.zeros(c, dtype=torch.float64, device=run.device)
        else:
            self.class_logits = torch.zeros(c, c, device=run.device)
            self.known = torch.zeros(c, dtype=torch.bool, device=run.device)

    @property
    def released(self) -> bool:
        return self.params.form == "released"

    def server_payload(self, round_, client_id, global_weights):
        if self.released:
            return {"weights": global_weights, "targets": self.targets}
        return {"weights": global_weights, "class_logits": self.class_logits, "class_known": self.known}

    def begin_local(self, model, ctx):
        if self.released:
            return None
        c = self.run.num_classes
        device = ctx.payload["weights"].device
        # Asked once per round, not per step: whether any class has a global logit yet (round 1: none).
        return DistillRound(torch.zeros(c, c, device=device), torch.zeros(c, device=device),
                            bool(self.params.lam) and bool(ctx.payload["class_known"].any()))

    def local_loss(self, model, x, y, ctx, state):
        logits = model(x)
        loss = F.cross_entropy(logits, y)
        if self.released:
            if self.params.lam:
                targets = ctx.payload["targets"].to(logits.dtype)[y]
                loss = loss + self.params.lam * released_term(torch.softmax(logits, dim=1), targets, self.params.loss)
            return loss
        with torch.no_grad():
            state.logit_sums.index_add_(0, y, logits.detach().float())
            state.logit_counts.index_add_(0, y, torch.ones_like(y, dtype=torch.float32))
        if state.distill:
            loss = loss + self.params.lam * distill_term(logits, y, ctx.payload["class_logits"],
                                                         ctx.payload["class_known"])
        return loss

    def client_upload(self, model, ctx, state):
        upload = super().client_upload(model, ctx, state)
        if self.released:
            # After training, in eval mode, over the client's whole set (Updata.py lines 237-257).
            data, c = ctx.data, self.run.num_classes
            was_training = model.training
            model.eval()
            sums = torch.zeros(c, c, dtype=torch.float64, device=ctx.device)
            counts = torch.zeros(c, dtype=torch.float64, device=ctx.device)
            with torch.no_grad():
                for start in range(0, len(data), 1024):
                    x, y = ctx.batch(data.indices[start: start + 1024])
                    sums.index_add_(0, y, torch.softmax(model(x), dim=1).to(torch.float64))
                    counts.index_add_(0, y, torch.ones_like(y, dtype=torch.float64))
            model.train(was_training)
            return {**upload, "prob_sums": sums, "prob_counts": counts}
        sums, counts = state.logit_sums, state.logit_counts
        means = sums / counts.clamp(min=1).unsqueeze(1)
        return {**upload, "class_logits": means, "class_counts": counts}

    def aggregate(self, round_, global_weights, uploads):
        p = self.params
        if self.released:
            for u in uploads:
                self.prob_sums += u["prob_sums"].to(self.prob_sums.device)
                self.prob_counts += u["prob_counts"].to(self.prob_counts.device)
            self.targets = aggregate_released(self.targets, self.prob_sums, self.prob_counts, p.blend)
        else:
            self.class_logits, self.known = aggregate_class_logits(
                self.class_logits, self.known, [u["class_logits"] for u in uploads],
                [u["class_counts"] for u in uploads], p.class_weighting, p.absent_classes)
        return super().aggregate(round_, global_weights, uploads)

    def server_state(self):
        if self.released:
            return {"targets": self.targets, "prob_sums": self.prob_sums, "prob_counts": self.prob_counts}
        return {"class_logits": self.class_logits, "class_known": self.known}

    def load_server_state(self, state):
        if self.released:
            self.targets, self.prob_sums, self.prob_counts = state["targets"], state["prob_sums"], state["prob_counts"]
        else:
            self.class_logits, self.known = state["class_logits"], state["class_known"].bool()
