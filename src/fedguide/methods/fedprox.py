"""FedProx (Li et al., 2020): a proximal term keeps local weights near the global model.

Local objective h_k(w) = F_k(w) + (mu/2)·||w − w_global||² (Eq. 2 of the paper): squared norm,
over trainable parameters only.
"""
import torch
from pydantic import BaseModel, ConfigDict, Field

from fedguide.methods.base import METHODS, Method


class FedProxParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    mu: float = Field(1e-3, ge=0.0, description="proximal coefficient")


def proximal_term(params: list[torch.Tensor], anchor: list[torch.Tensor], mu: float) -> torch.Tensor:
    """(mu/2)·Σ||p − a||², batched with foreach kernels (one autograd node per tensor list)."""
    diffs = torch._foreach_sub(params, anchor)
    sq = torch.stack(torch._foreach_norm(diffs)).square().sum()
    return 0.5 * mu * sq


@METHODS.register("fedprox", params=FedProxParams)
class FedProx(Method):
    """FedProx: FedAvg plus (mu/2)·||w − w_global||² in the local objective."""

    def begin_local(self, model, ctx):
        ctx.scratch["anchor"] = [p.detach().clone() for p in model.parameters()]
        ctx.scratch["params"] = list(model.parameters())

    def local_loss(self, model, x, y, ctx):
        loss = super().local_loss(model, x, y, ctx)
        if self.params.mu == 0:
            return loss
        return loss + proximal_term(ctx.scratch["params"], ctx.scratch["anchor"], self.params.mu)
