"""RSCFed (Liang, Lin, Fu, Zhu & Li, CVPR 2022, "RSCFed: Random Sampling Consensus Federated
Semi-supervised Learning"), one of FedDISC's multi-round baselines (the FedDISC paper Table 1; 100 rounds
there). Its paper is not among the project's papers: this follows its core ideas and the defaults of its
released code's README (read, not copied), on FedDISC's classifier (frozen image encoder + linear head,
see _head_federation).

RSCFed's labeled party is a labeled client; in FedDISC's setting the server holds the labels, so the
server plays that party. Each round:
1. Every sampled client trains the received head as a mean-teacher student: its teacher is an exponential
   moving average of its own student (kept in the client's state, initialised from the first head it
   receives, decay min(1 − 1/(step+1), ``ema_decay``) per step); the target of each image is the teacher's
   softmax on the un-augmented image, sharpened with temperature ``sharpen_temperature``; the loss is
   ``unsup_weight`` · Σ_c (softmax(student(strong view)) − target)², averaged over the batch; SGD with
   lr ``unsup_lr_scale`` · train.lr, gradient norm clipped to ``max_grad_norm``.
2. The server trains the head on its labeled set with cross-entropy (train.lr, train.epochs) — the
   labeled party.
3. Random sub-consensus: ``subsets`` times, ``subset_size`` parties are drawn without replacement among the
   round's parties (server + clients). Within a subset, distance-reweighted aggregation: base weights
   q_i = n_i (×``labeled_weight`` for the labeled party), the weighted mean w̄, d_i = Σ_tensors ‖w_i − w̄‖,
   q'_i = q_i·exp(−d_i·s/n_i) with s = ``sup_scale`` when the labeled party is in the subset, else
   ``dist_scale``, the labeled party's q' multiplied by ``labeled_weight`` once more (as the released
   code does), normalised; the subset's model is Σ q'_i w_i. The new global head is the plain mean of the
   sub-consensus models.

Decisions: each party trains once per round and the subsets are drawn among the trained heads (the released
code retrains a party for every subset it is drawn into, from the same global start); the released
code's linear ramp-up of the unsupervised weight is left out (``unsup_weight`` holds from round 1);
the exponent is computed in log space, so a subset whose weights all underflow still aggregates. The weak
view is the image itself, strong views come from a bank encoded once (see _augment).
"""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field

from fedguide.core.seeding import derive_seed
from fedguide.methods.frozen_encoder.heads._augment import strong_augment
from fedguide.methods.frozen_encoder._frozen_encoder import Head, head_logits, sgd_steps
from fedguide.methods.frozen_encoder.heads._head_federation import HeadFederation, HeadParams
from fedguide.methods.base import METHODS

VIEW_TAG, SUBSET_TAG = 51, 52


class RSCFedParams(HeadParams):
    subsets: int = Field(3, ge=1, description="sub-consensus models per round (released code: meta_round 3)")
    subset_size: int = Field(5, ge=1, description="parties per subset (released code: meta_client_num 5)")
    labeled_weight: float = Field(6.0, gt=0.0,
                                  description="scaling of the labeled party (released code: w_mul_times 6)")
    sup_scale: float = Field(100.0, ge=0.0, description="distance scale of a subset holding the labeled party")
    dist_scale: float = Field(1e4, ge=0.0, description="distance scale of a subset of unlabeled clients only")
    ema_decay: float = Field(0.999, ge=0.0, lt=1.0, description="mean-teacher EMA decay")
    sharpen_temperature: float = Field(0.5, gt=0.0, description="temperature sharpening the teacher's targets")
    unsup_weight: float = Field(0.02, ge=0.0, description="weight of the consistency loss (released code: lambda_u)")
    unsup_lr_scale: float = Field(0.7, gt=0.0, description="client lr = this × train.lr (released code: 0.021 / 0.03)")
    max_grad_norm: float = Field(5.0, gt=0.0, description="gradient norm clipping of the clients")
    strong_views: int = Field(4, ge=1, description="strongly augmented copies per client image, encoded once")


def sharpen(probs: torch.Tensor, temperature: float) -> torch.Tensor:
    p = probs.pow(1.0 / temperature)
    return p / p.sum(1, keepdim=True)


def head_distance(a: Head, b: Head) -> float:
    """Σ over the head's tensors of ‖a − b‖₂ (the released code's model distance)."""
    return float(sum(torch.linalg.vector_norm((a[k] - b[k]).double()) for k in ("weight", "bias")))


def distance_reweighted(heads: list[Head], sizes: list[float], labeled: list[bool], labeled_weight: float,
                        sup_scale: float, dist_scale: float) -> tuple[Head, np.ndarray]:
    """One sub-consensus model (module docstring, step 3) and the weights it used."""
    n = np.asarray(sizes, dtype=np.float64)
    if (n <= 0).any():
        raise ValueError(f"party sizes must be positive, got {sizes}")
    is_lab = np.asarray(labeled, dtype=bool)
    q = n * np.where(is_lab, labeled_weight, 1.0)
    q = q / q.sum()
    mean = {k: sum(float(w) * h[k].double() for w, h in zip(q, heads)) for k in ("weight", "bias")}
    dist = np.array([head_distance(h, mean) for h in heads])
    scale = sup_scale if is_lab.any() else dist_scale
    log_w = np.log(q) - dist * scale / n + np.where(is_lab, math.log(labeled_weight), 0.0)
    w = np.exp(log_w - log_w.max())
    w = w / w.sum()
    out = {k: sum(float(wi) * h[k].double() for wi, h in zip(w, heads)).to(heads[0][k].dtype)
           for k in ("weight", "bias")}
    return out, w


@METHODS.register("rscfed", params=RSCFedParams)
class RSCFed(HeadFederation):
    """RSCFed: mean-teacher clients, random sub-consensus with distance-reweighted aggregation."""

    paper = "https://arxiv.org/abs/2203.13993"

    def client_train(self, head, ctx):
        p, t = self.params, self.run.train
        x = self.client_features(ctx)
        views = self.features.augmented_views(
            ctx.data.indices.numpy(), p.strong_views, strong_augment,
            derive_seed(self.run.seed, "client", 0, ctx.client_id, VIEW_TAG) % 2 ** 31)
        state = ctx.state
        teacher = ({"weight": state["teacher_weight"].clone(), "bias": state["teacher_bias"].clone()}
                   if "teacher_weight" in state else {k: v.clone() for k, v in head.items()})
        step = [int(state.get("ema_steps", 0))]
        gen = self.client_generator(ctx)

        def loss_fn(params, idx):
            with torch.no_grad():
                target = sharpen(F.softmax(head_logits(teacher, x[idx]), dim=1), p.sharpen_temperature)
            pick = torch.randint(0, p.strong_views, (len(idx),), generator=gen)
            probs = F.softmax(head_logits(params, views[pick, idx]), dim=1)
            return p.unsup_weight * (probs - target).pow(2).sum(1).mean()

        def ema(params):
            alpha = min(1.0 - 1.0 / (step[0] + 1), p.ema_decay)
            for k in teacher:
                teacher[k].mul_(alpha).add_(params[k].detach(), alpha=1 - alpha)
            step[0] += 1

        trained, loss, _ = sgd_steps(head, len(x), t.epochs, t.batch_size, p.unsup_lr_scale * t.lr, t.momentum,
                                     t.weight_decay, gen, loss_fn, after_step=ema, max_grad_norm=p.max_grad_norm)
        ctx.update_state(teacher_weight=teacher["weight"], teacher_bias=teacher["bias"], ema_steps=step[0])
        return trained, loss, float(len(x))

    def server_update(self, round_, uploads):
        p = self.params
        idx, x, y = self.labeled()
        server_head, _ = self.train_supervised(self.global_head(), x, y, self.run.train.epochs,
                                               self.server_generator(round_))
        heads = [server_head] + [{"weight": u["head_weight"], "bias": u["head_bias"]} for u in uploads]
        sizes = [float(len(idx))] + [float(u["num_samples"]) for u in uploads]
        labeled = [True] + [False] * len(uploads)
        rng = np.random.default_rng(derive_seed(self.run.seed, "sampling", round_, SUBSET_TAG))
        size = min(p.subset_size, len(heads))
        consensus = []
        for _ in range(p.subsets):
            chosen = np.sort(rng.choice(len(heads), size=size, replace=False))
            model, _ = distance_reweighted([heads[i] for i in chosen], [sizes[i] for i in chosen],
                                           [labeled[i] for i in chosen], p.labeled_weight, p.sup_scale, p.dist_scale)
            consensus.append(model)
        return {k: torch.stack([m[k] for m in consensus]).mean(0) for k in ("weight", "bias")}
