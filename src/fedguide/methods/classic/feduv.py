"""FedUV (Son, Kim, Chung, Huang, Liu, CVPR 2024, "FedUV: Uniformity and Variance for Heterogeneous
Federated Learning"): two regularisers that make a client's training behave as it would on IID data.

Local objective: L = CE + λ_V·L_V + λ_U·L_U; server: FedAvg.

- Classifier variance (L_V): on IID data a client's softmax outputs spread over every class; under label
  skew the columns of the classes it lacks collapse. A hinge on the standard deviation of each class
  column of the batch's probabilities p = softmax(g(z)) [B, C] keeps them spread:
      L_V = 1/C · Σ_c max(0, γ − std_b(p_bc)),
  std the unbiased (B − 1) batch standard deviation, γ the deviation of a column of the C×C identity
  (one-hot predictions of a class-balanced batch), γ = √(1/C).
- Representation uniformity (L_U): a Gaussian potential over the pairs of the batch's representations
  z (the vector the classification layer takes) spreads them over the space:
      L_U = mean_{i<j} exp(−‖z_i − z_j‖² / σ),
  σ the median of the batch's non-zero squared pairwise distances (torch.median: the lower middle value
  for an even count), so that the term does not depend on the scale of z.

Sources and decisions:
- The forms, γ and the median bandwidth follow the released code (github.com/sonhamin/FedUV,
  algs/feduv.py, class UVReg): p.std(dim=0) (unbiased), γ = torch.eye(C).std(0).mean(), pdist² with
  its median, the mean of exp(−d²/σ) without a logarithm, and σ left in the graph: the median pair's
  distance is differentiated through σ as well, which can pull that pair together while the others are
  pushed apart (``detach_bandwidth: true`` holds σ constant, the usual median heuristic).
  The paper's equations were not at hand offline; check them when they are.
- Defaults λ_V = 2.5 (``var_weight``, the code's ``--std_coeff``) and λ_U = 0.5 (``unif_weight``, its
  ``--unif_coeff``).
- ``gamma: null`` takes √(1/C); a number sets the target deviation directly.
- A batch of one sample has no deviation and no pair: both terms are 0 for it. A batch whose
  representations all coincide has no non-zero distance: L_U is then 0 as well (a degenerate batch the
  released code would crash on).
- Global accuracy: the averaged model on the global test set (FedAvg's).

``regularizers: [dw]`` composes FedDW's term with it (FedDW Table IV, FedUV+DW): the local loop is the
run's, so the composed loss is CE + λ_V·L_V + λ_U·L_U + μ·L_reg.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field

from fedguide.methods.base import METHODS, Method


class FedUVParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    var_weight: float = Field(2.5, ge=0.0, description="λ_V, weight of the classifier-variance hinge (code: 2.5)")
    unif_weight: float = Field(0.5, ge=0.0, description="λ_U, weight of the representation uniformity (code: 0.5)")
    gamma: Optional[float] = Field(None, gt=0.0, description="target std of each class column; null = √(1/C)")
    detach_bandwidth: bool = Field(False, description="treat σ as a constant (the released code differentiates "
                                                      "through the median distance)")


def iid_target_std(num_classes: int) -> float:
    """γ: the unbiased standard deviation of a column of the C×C identity, √(1/C)."""
    return (1.0 / num_classes) ** 0.5


def variance_loss(logits: torch.Tensor, gamma: float) -> torch.Tensor:
    """L_V = mean_c max(0, γ − std_b softmax(logits)_bc) (unbiased batch std); 0 for a single sample."""
    if logits.shape[0] < 2:
        return logits.sum() * 0.0
    std = torch.softmax(logits.float(), dim=1).std(dim=0)
    return F.relu(gamma - std).mean()


def uniformity_loss(z: torch.Tensor, detach_bandwidth: bool = False) -> torch.Tensor:
    """L_U = mean_{i<j} exp(−‖z_i − z_j‖² / σ), σ = median of the non-zero squared distances (a constant
    with ``detach_bandwidth``)."""
    if z.shape[0] < 2:
        return z.sum() * 0.0
    sq = torch.pdist(z.flatten(1).float(), p=2).pow(2)
    # The median of the non-zero distances without selecting them (a selection's size is known only to the
    # device: the host would wait for it every step): zeros become NaN, which nanmedian skips; NaN when
    # every distance is zero, and then the loss is 0 (a finite stand-in bandwidth keeps the gradient finite).
    sigma = torch.nanmedian(sq.masked_fill(sq == 0, float("nan")))
    none = torch.isnan(sigma)
    bandwidth = torch.where(none, torch.ones_like(sigma), sigma)
    loss = sq.mul(-1.0 / (bandwidth.detach() if detach_bandwidth else bandwidth)).exp().mean()
    return torch.where(none, z.sum() * 0.0, loss)


@METHODS.register("feduv", params=FedUVParams)
class FedUV(Method):
    """FedUV: CE + λ_V·classifier-variance hinge + λ_U·representation uniformity; FedAvg aggregation."""

    paper = "https://arxiv.org/abs/2402.18372"

    def __init__(self, params, run):
        super().__init__(params, run)
        self.gamma = params.gamma if params.gamma is not None else iid_target_std(run.num_classes)

    def local_loss(self, model, x, y, ctx, state):
        p = self.params
        z, logits = model.forward_features(x)
        loss = F.cross_entropy(logits, y)
        if p.var_weight:
            loss = loss + p.var_weight * variance_loss(logits, self.gamma)
        if p.unif_weight:
            loss = loss + p.unif_weight * uniformity_loss(z, p.detach_bandwidth)
        return loss
