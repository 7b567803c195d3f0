"""FedProx (Li et al., 2020): a proximal term keeps local weights near the global model.

Local objective h_k(w) = F_k(w) + (mu/2)·||w − w_global||² (Eq. 2 of the paper): squared norm,
over trainable parameters only.

The term's gradient is mu·(w − w_global) in closed form. By default (``gradient: direct``) it is
added to the gradients after backward, which is exactly the gradient of the objective above at a
fraction of autograd's cost; the reported training loss is then the task loss alone.
``gradient: autograd`` puts the term into the loss instead (same updates, loss includes the term).
"""
from dataclasses import dataclass
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from fedguide.methods.base import METHODS, Method


class FedProxParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    mu: float = Field(1e-3, ge=0.0, description="proximal coefficient")
    gradient: Literal["direct", "autograd"] = Field(
        "direct", description="add mu·(w − w_global) to the gradients, or trace the term with autograd")


def proximal_term(params: list[torch.Tensor], anchor: list[torch.Tensor], mu: float) -> torch.Tensor:
    """(mu/2)·Σ||p − a||², batched with foreach kernels (one autograd node per tensor list)."""
    diffs = torch._foreach_sub(params, anchor)
    sq = torch.stack(torch._foreach_norm(diffs)).square().sum()
    return 0.5 * mu * sq


def add_proximal_gradient_(params: list[torch.Tensor], anchor: list[torch.Tensor], mu: float) -> None:
    """p.grad += mu·(p − a): the gradient of ``proximal_term``, in place."""
    for p in params:
        if p.grad is None:  # a parameter the task loss did not reach still feels the pull
            p.grad = torch.zeros_like(p)
    with torch.no_grad():
        torch._foreach_add_([p.grad for p in params], torch._foreach_sub(params, anchor), alpha=mu)


@dataclass
class ProxRound:
    """A client's round: its trainable parameters and their values at the start (the proximal anchor)."""

    params: list[torch.Tensor]
    anchor: list[torch.Tensor]


@METHODS.register("fedprox", params=FedProxParams)
class FedProx(Method):
    """FedProx: FedAvg plus (mu/2)·||w − w_global||² in the local objective."""

    paper = "https://arxiv.org/abs/1812.06127"

    def begin_local(self, model, ctx) -> ProxRound:
        params = [p for p in model.parameters() if p.requires_grad]
        return ProxRound(params, [p.detach().clone() for p in params])

    def local_loss(self, model, x, y, ctx, state: ProxRound):
        loss = super().local_loss(model, x, y, ctx, state)
        if self.params.mu == 0 or self.params.gradient == "direct":
            return loss
        return loss + proximal_term(state.params, state.anchor, self.params.mu)

    def after_backward(self, model, ctx, state: ProxRound):
        if self.params.mu and self.params.gradient == "direct":
            add_proximal_gradient_(state.params, state.anchor, self.params.mu)
