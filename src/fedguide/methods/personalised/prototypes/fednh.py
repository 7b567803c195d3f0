"""FedNH (Dai et al., AAAI 2023, "Tackling Data Heterogeneity in Federated Learning with Class Prototypes").

The classifier is a set of C unit-norm class prototypes p_c, spread uniformly over the hypersphere at the
start ("uniformity") and moved towards the clients' class means on the server ("semantics"):
- client objective: cross-entropy of the logits s · cos(z, p_c) with the prototypes frozen (no gradient);
- client upload: the encoder weights and, per class, the mean of the L2-normalised features
  μ_k,c = (1/n_k,c) Σ_{y_i=c} z_i/‖z_i‖ with its count n_k,c (computed after local training);
- server: encoder weights by FedAvg; prototypes p_c ← normalise(ρ·p_c + (1−ρ)·Σ_k (n_k,c/N_c) μ_k,c)
  with ρ = 0.7 (the value the FedDifRC/SemanticFL tables use; the released code defaults to 0.9).
  A class no client of the round holds keeps its prototype.

Decisions and deviations:
- Head = the SplitModel's ``nn.Linear(d, C)``: its weight rows hold the prototypes; its bias is set to
  zero in ``init_global`` and reset to zero at every aggregation; it is never used (logits are computed
  from the encoder output and the detached head weight), so no gradient or weight decay ever reaches the
  head. With unit prototypes and zero bias, the plain ``model(x)`` argmax equals the cosine argmax.
- The paper's text was not at hand when this was written; where it is cited below from memory or read off
  the released code (github.com/Yutong-Dai/FedNH), that is said. Check against the paper and adjust.
- Initialisation (``init: spread``): prototypes "uniformly distributed on the unit hypersphere", taken
  as the max-min (Tammes) problem: maximise the smallest pairwise distance, as in Mettes et al. 2019
  (hyperspherical prototypes, who minimise the mean over classes of the largest cosine). Solved by
  projected gradient descent on a smooth min (log-sum-exp, t = 30) of the pairwise Euclidean distances,
  seeded, float64: the cosine objective's gradient vanishes between nearly coincident points and left
  pairs collapsed in tests. For C ≤ d + 1 it reaches the regular simplex (max cosine −1/(C−1)). Cost
  O(steps·C²·d): negligible for C ≤ 200. ``init: orthogonal`` is the released code's choice
  (orthonormal rows, max cosine 0, needs C ≤ d).
- Scale s: the released code learns s as a model parameter (``FedNH_fix_scaling: False``; initialised to
  1.0 for its CNN, 20 for ResNet-18, averaged with the weights; 30 when fixed). The SplitModel has no slot
  for it and the engine's optimiser sees only model parameters, so a learnable s (``learn_scale: true``)
  is a scalar the client optimises with an optimiser of the run's kind and settings, stepping one batch
  late (before the next forward, and once more before upload: the same updates as a joint step),
  uploaded and sample-weighted averaged by the server (server state, sent in the payload). Default:
  fixed s = ``scale`` = 30: on configs/smoke.yaml a learned s from 1.0 reached only 1.3 after 3 rounds
  (59 % accuracy, loss still near log C) against 66 % with s = 30.
- ``normalize_means`` (default false, the equation above): true = released code, which L2-normalises
  every client's class mean before the count-weighted average and the average again before smoothing.
- The released code also clips gradients to norm 10; the engine has no clipping, so neither do we.
- ``accuracy`` = argmax of s·cos(z, p_c) of the global model on the test set; ``test_loss`` its CE.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional, Sequence

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from fedguide.core.aggregation import sample_weighted_average, weighted_average
from fedguide.core.seeding import derive_seed
from fedguide.core.training import make_optimizer
from fedguide.methods.base import METHODS, Method
from fedguide.methods.personalised.prototypes.fedproto import aggregate_prototypes, class_feature_means

# The prototype stream is the model-init purpose with an extra key, distinct from the weights' own stream.
PROTOTYPE_SEED_KEY = 1


class FedNHParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    rho: float = Field(0.7, ge=0.0, le=1.0, description="ρ, smoothing of the prototype update (weight of the old)")
    scale: float = Field(30.0, gt=0.0, description="s in logits = s·cos(z, p_c); the initial value if learned")
    learn_scale: bool = Field(False, description="learn s on clients and average it (released code)")
    init: Literal["spread", "orthogonal"] = Field("spread", description="prototype initialisation")
    init_steps: int = Field(1000, ge=0, description="gradient steps of the spread initialisation")
    normalize_means: bool = Field(False, description="normalise client and aggregated class means (released code)")


def spread_prototypes(num_classes: int, dim: int, seed: int, steps: int = 1000, lr: float = 0.2,
                      sharpness: float = 30.0) -> torch.Tensor:
    """C unit vectors in R^d spread over the sphere: maximise the (smooth) smallest pairwise distance.

    Descent on Σ_i (1/t)·log Σ_{j≠i} exp(−t‖p_i − p_j‖), projected on the sphere, step size decaying
    linearly to 0. Deterministic for a given seed (float64 on CPU). Returns float32 (C, d).
    """
    gen = torch.Generator().manual_seed(seed)
    p = F.normalize(torch.randn(num_classes, dim, generator=gen, dtype=torch.float64), dim=1)
    if num_classes < 2:
        return p.to(torch.float32)
    eye = torch.eye(num_classes, dtype=torch.bool)
    for k in range(steps):
        dist = (2 - 2 * (p @ p.T)).clamp(min=1e-12).sqrt().masked_fill(eye, float("inf"))
        w = torch.softmax(-sharpness * dist, dim=1)
        # Gradient of the objective: each pair repels along the unit vector between them, with a force
        # that does not vanish as the pair gets close (unlike the gradient of a cosine).
        a = (w + w.T) / dist
        push = a.sum(1, keepdim=True) * p - a @ p
        push = push - (push * p).sum(1, keepdim=True) * p
        p = F.normalize(p + lr * (1 - k / steps) * push, dim=1)
    return p.to(torch.float32)


def orthogonal_prototypes(num_classes: int, dim: int, seed: int) -> torch.Tensor:
    """C orthonormal rows (the released code's ``FedNH_head_init: orthogonal``); needs C ≤ d."""
    if num_classes > dim:
        raise ValueError(f"orthogonal prototypes need num_classes ({num_classes}) <= feature dim ({dim}); "
                         "use method.init=spread")
    gen = torch.Generator().manual_seed(seed)
    q, r = torch.linalg.qr(torch.randn(dim, num_classes, generator=gen, dtype=torch.float64))
    return (q * torch.sign(torch.diagonal(r))).T.contiguous().to(torch.float32)


def smooth_prototypes(old: torch.Tensor, new_means: torch.Tensor, rho: float) -> torch.Tensor:
    """p_c ← normalise(ρ·p_c + (1−ρ)·m_c); a class whose m_c is zero (nobody holds it) keeps p_c."""
    has_data = new_means.norm(dim=1) > 0
    mixed = F.normalize(rho * old + (1 - rho) * new_means, dim=1)
    return torch.where(has_data.unsqueeze(1), mixed, old)


def cosine_logits(z: torch.Tensor, protos: torch.Tensor, scale) -> torch.Tensor:
    """s · cos(z, p_c) for every class c."""
    return scale * (F.normalize(z, dim=1) @ F.normalize(protos, dim=1).T)


def aggregate_class_means(means: Sequence[torch.Tensor], counts: Sequence[torch.Tensor],
                          normalize: bool) -> torch.Tensor:
    """Count-weighted mean of the clients' class means (released-code variant: normalised before and after)."""
    if normalize:
        means = [F.normalize(m, dim=1) for m in means]
    agg, _ = aggregate_prototypes(means, counts)
    return F.normalize(agg, dim=1) if normalize else agg


@dataclass
class NHRound:
    """A client's round: the normalised prototypes it trains against and, with ``learn_scale``, the scale it
    learns and that scale's optimiser."""

    protos: torch.Tensor
    scale: Optional[nn.Parameter] = None
    scale_opt: Optional[torch.optim.Optimizer] = None


@METHODS.register("fednh", params=FedNHParams)
class FedNH(Method):
    """FedNH: frozen hyperspherical prototype head (cosine logits), prototypes smoothed towards client class means."""

    def setup(self):
        self.head_weight = self.run.layout.span("head.weight")
        self.head_bias = self.run.layout.span("head.bias") if "head.bias" in self.run.layout.names else None
        self.scale = torch.tensor(self.params.scale, dtype=torch.float32, device=self.run.device)

    def init_global(self, weights):
        c, d = self.run.num_classes, self.run.model.feature_dim
        seed = derive_seed(self.run.seed, "model", PROTOTYPE_SEED_KEY)
        if self.params.init == "spread":
            protos = spread_prototypes(c, d, seed, steps=self.params.init_steps)
        else:
            protos = orthogonal_prototypes(c, d, seed)
        weights = weights.clone()
        weights[self.head_weight] = protos.reshape(-1).to(weights.device)
        if self.head_bias is not None:
            weights[self.head_bias] = 0.0
        return weights

    def _protos(self, weights: torch.Tensor) -> torch.Tensor:
        return weights[self.head_weight].view(self.run.num_classes, self.run.model.feature_dim)

    def server_payload(self, round_, client_id, global_weights):
        payload = {"weights": global_weights}
        if self.params.learn_scale:
            payload["scale"] = self.scale
        return payload

    def begin_local(self, model, ctx) -> NHRound:
        # Detached copy: the loss never touches the head's parameters, so they get no gradient.
        state = NHRound(F.normalize(model.head.weight.detach().clone(), dim=1))
        if self.params.learn_scale:

            holder = nn.Module()
            holder.scale = nn.Parameter(ctx.payload["scale"].detach().clone().reshape(()))
            state.scale = holder.scale
            state.scale_opt = make_optimizer(holder, self.run.train)
        return state

    def local_optimizers(self, ctx, state: NHRound):
        # the learned scale steps with the model, through the loop (fp16: unscaled and skipped on overflow)
        return [state.scale_opt] if self.params.learn_scale else []

    def local_loss(self, model, x, y, ctx, state: NHRound):
        if self.params.learn_scale:
            scale = state.scale
        else:
            scale = self.params.scale
        return F.cross_entropy(cosine_logits(model.encoder(x), state.protos, scale), y)

    def client_upload(self, model, ctx, state: NHRound):
        means, counts = class_feature_means(model, ctx.data, self.run.train.eval_batch_size, normalize=True,
                                            fetch=ctx.batch)
        upload = {"weights": self.run.layout.flatten(model), "num_samples": len(ctx.data),
                  "class_means": means, "class_counts": counts}
        if self.params.learn_scale:
            upload["scale"] = state.scale.detach().clone()
        return upload

    def aggregate(self, round_, global_weights, uploads):
        sizes = [u["num_samples"] for u in uploads]
        new = sample_weighted_average([u["weights"] for u in uploads], sizes)
        means = aggregate_class_means([u["class_means"] for u in uploads], [u["class_counts"] for u in uploads],
                                      self.params.normalize_means)
        protos = smooth_prototypes(self._protos(global_weights), means, self.params.rho)
        new[self.head_weight] = protos.reshape(-1)
        if self.head_bias is not None:
            new[self.head_bias] = 0.0
        if self.params.learn_scale:
            self.scale = weighted_average([u["scale"].reshape(1) for u in uploads], sizes).reshape(())
        return new

    def evaluate(self, round_, global_weights):
        z, _, y = self.run.evaluator.features(global_weights)
        logits = cosine_logits(z, self._protos(global_weights), self.scale)
        return {**self.run.evaluator.score(logits.argmax(1), logits), "scale": float(self.scale)}

    def server_state(self):
        # The prototypes live in the global weights (the head), which the checkpoint already holds.
        return {"scale": self.scale.reshape(1)}

    def load_server_state(self, state):
        if set(state) != {"scale"}:
            raise ValueError(f"fednh checkpoint state should hold scale, got {sorted(state)}")
        self.scale = state["scale"].reshape(()).clone()
