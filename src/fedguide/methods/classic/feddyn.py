"""FedDyn (Acar, Zhao, Matas, Mattina, Whatmough & Saligrama, ICLR 2021, "Federated Learning Based on Dynamic
Regularization").

Client k, holding a gradient state g_k (zero before its first round), trains from the server model x on
    L_k(θ) − ⟨g_k, θ⟩ + (α/2)·||θ − x||²
then updates g_k ← g_k − α·(θ_k − x). The server keeps h (zero at the start):
    h ← h − α·(1/m)·Σ_{k∈P} (θ_k − x),     x ← (1/|P|)·Σ_{k∈P} θ_k − h/α
with m all clients and P the round's participants (Algorithm 1 of the paper).

The authors' code (github.com/alpemreacar/FedDyn) is followed line by line:
- ``utils_general.py`` ``train_feddyn_mdl`` L185-242: the loss is the batch-mean cross-entropy plus
  α_k·⟨θ, −x + l_k⟩ (L219) with l_k = Σ (θ_k − x) over the client's rounds (``utils_methods.py`` L393), i.e.
  −⟨g_k, θ⟩ − α_k⟨θ, x⟩ with g_k = −α_k·l_k; the gradients are clipped to norm 10 (L224, ``max_norm``, L8); the
  quadratic part (α_k/2)·||θ||² enters as SGD weight decay α_k + ``weight_decay`` (L190), after the clipping.
  Linear and quadratic parts together are −⟨g_k, θ⟩ + (α_k/2)·||θ − x||² up to a constant.
- ``utils_methods.py`` L296-297, L387: α_k = α / (n_k·N / Σ_j n_j), α scaled down for large clients.
- L393: l_k += θ_k − x (here g_k ← g_k − α_k·(θ_k − x), the same state in the paper's units);
  L396-397: x = mean over the round's clients of θ_k + mean over all N clients of l_k (= avg − h/α above).

Here the linear term and both quadratic parts are added to the gradients after backward (their gradients in
closed form: −g_k − α_k·x, then the clipping, then α_k·θ), so the run's optimiser (``train``: lr, momentum,
``weight_decay``) steps on exactly the official gradient; the reported training loss is the cross-entropy alone.
g_k lives in the client's disk state, h is server state (checkpointed), so a resumed run continues exactly.

Defaults and decisions:
- α = 0.01 (``example_cifar_10.py`` L65, ``alpha_coef``); ``alpha_scaling: samples`` (default, L387) or ``none``
  (the paper's one α for every client); ``max_grad_norm`` 10 (L8), null for none.
- The official example trains with plain SGD, lr 0.1, weight decay 1e-3, batch 50, 5 epochs (L40-45): the run's
  ``train`` settings, not the method's.
- The terms cover the trainable parameters (the official code's ``named_parameters``); buffers (BatchNorm
  statistics, which the official models lack) are the plain mean of the clients' buffers, untouched by h.
- Participation: the official code draws each client with probability ``act_prob`` (L360-369); the engine's
  ``clients.per_round`` sampling sets P here. The mean over P is uniform (L396, ``np.mean``).
- ``evaluate: average`` (default): the model tested and saved is the mean of the round's client models, the one
  the official code reports (``avg_model``, L399 and L404-406, "Communication sel ... Test Accuracy"); the clients
  still start from x = average − h/α, sent in the payload. ``evaluate: server``: x itself (the official
  ``cld_model``, saved beside it at L423).
- PFLlib (TsingZ0/PFLlib, ``clientdyn.py`` L43-46, L52-54) differs: (α/2)·||θ − x|| without the square, one α
  for every client, no clipping; the FedDW authors' code (liuvvvvv1/FedDW) has no FedDyn.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

import torch
from pydantic import BaseModel, ConfigDict, Field

from fedguide.core.aggregation import weighted_average
from fedguide.methods.base import METHODS, Method


class FedDynParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    alpha: float = Field(0.01, gt=0.0, description="α: the dynamic regulariser's coefficient (the official "
                                                   "alpha_coef 1e-2)")
    alpha_scaling: Literal["samples", "none"] = Field(
        "samples", description="samples: α_k = α·(mean client size)/n_k (the official code); none: α for every "
                               "client (the paper)")
    max_grad_norm: Optional[float] = Field(10.0, gt=0.0, description="clip the gradient (task and linear term) to "
                                                                     "this norm before the step (the official 10); "
                                                                     "null: no clipping")
    evaluate: Literal["average", "server"] = Field(
        "average", description="the model tested and saved: average = the mean of the round's client models "
                               "(the official avg_model); server = x = average − h/α")


def client_alpha(alpha: float, sizes: list[int], client_id: int, scaling: str) -> float:
    """α_k = α / (n_k·N / Σ_j n_j) (utils_methods.py L296-297, L387), or α unscaled."""
    if scaling == "none":
        return alpha
    return alpha * sum(sizes) / (len(sizes) * sizes[client_id])


def gradient_state_update(grad: torch.Tensor, theta: torch.Tensor, x: torch.Tensor, alpha_k: float,
                          mask: torch.Tensor) -> torch.Tensor:
    """g_k ← g_k − α_k·(θ_k − x) on the parameter entries (``mask`` 1, buffers 0): the official
    l_k += θ_k − x (utils_methods.py L393) in the paper's units g_k = −α_k·l_k."""
    return grad - alpha_k * mask * (theta - x)


def server_update(h: torch.Tensor, x: torch.Tensor, thetas: list[torch.Tensor], alpha: float, num_clients: int,
                  mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, average) after a round: h ← h − α·(1/m)·Σ_k mask·(θ_k − x), average = (1/|P|)·Σ_k θ_k; the next server
    model is average − h/α (``next_model``; utils_methods.py L396-397)."""
    average = weighted_average(thetas, [1.0] * len(thetas))
    drift = weighted_average([t - x for t in thetas], [1.0] * len(thetas)) * (len(thetas) / num_clients)
    return h - alpha * mask * drift, average


def next_model(average: torch.Tensor, h: torch.Tensor, alpha: float) -> torch.Tensor:
    """x = average − h/α."""
    return average - h / alpha


def clip_by_total_norm_(grads: list[torch.Tensor], max_norm: float) -> None:
    """Scale ``grads`` in place by min(1, max_norm / (||grads|| + 1e-6)), as ``torch.nn.utils.clip_grad_norm_``
    (utils_general.py L224), computed where they are, with no read of the norm on the host."""
    total = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
    torch._foreach_mul_(grads, torch.clamp(max_norm / (total + 1e-6), max=1.0))


@dataclass
class DynRound:
    """A client's round: its trainable parameters, −g_k − α_k·x per parameter (the gradient of the linear part),
    and α_k."""

    params: list[torch.Tensor]
    linear: list[torch.Tensor]
    alpha: float


@METHODS.register("feddyn", params=FedDynParams)
class FedDyn(Method):
    """FedDyn: a dynamic linear + quadratic regulariser per client, and a server state h correcting the average."""

    paper = "https://arxiv.org/abs/2111.04263"

    def __init__(self, params, run):
        super().__init__(params, run)
        self._mask: Optional[torch.Tensor] = None
        self.h: Optional[torch.Tensor] = None
        self._sizes = [len(idx) for idx in run.data.client_indices]

    @property
    def mask(self) -> torch.Tensor:
        """1.0 on the flat vector's trainable parameters, 0.0 on buffers (a float: no boolean indexing)."""
        if self._mask is None:
            self._mask = self.run.layout.parameter_mask(self.run.model).to(self.run.device, torch.float32)
        return self._mask

    def setup(self):
        self.h = torch.zeros(self.run.layout.numel, dtype=torch.float32, device=self.run.device)

    def server_payload(self, round_, client_id, global_weights):
        if self.params.evaluate == "server":
            return {"weights": global_weights}
        return {"weights": next_model(global_weights, self.h, self.params.alpha)}

    def begin_local(self, model, ctx) -> DynRound:
        alpha_k = client_alpha(self.params.alpha, self._sizes, ctx.client_id, self.params.alpha_scaling)
        x = ctx.payload["weights"]
        grad = ctx.state.get("grad")
        linear = -alpha_k * x if grad is None else -grad - alpha_k * x
        named = dict(model.named_parameters())
        params, parts, offset = [], [], 0
        for name, shape in zip(self.run.layout.names, self.run.layout.shapes):
            size = int(torch.Size(shape).numel())
            if name in named and named[name].requires_grad:
                params.append(named[name])
                parts.append(linear[offset: offset + size].view(shape))
            offset += size
        return DynRound(params, parts, alpha_k)

    def after_backward(self, model, ctx, state: DynRound):
        for p in state.params:
            if p.grad is None:  # a parameter the task loss did not reach still feels the regulariser
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in state.params]
        with torch.no_grad():
            torch._foreach_add_(grads, state.linear)
            if self.params.max_grad_norm is not None:
                clip_by_total_norm_(grads, self.params.max_grad_norm)
            torch._foreach_add_(grads, state.params, alpha=state.alpha)

    def client_upload(self, model, ctx, state: DynRound):
        theta, x = self.run.layout.flatten(model), ctx.payload["weights"]
        grad = ctx.state.get("grad")
        grad = torch.zeros_like(theta) if grad is None else grad
        ctx.update_state(grad=gradient_state_update(grad, theta, x, state.alpha, self.mask))
        return {"weights": theta, "num_samples": len(ctx.data)}

    def aggregate(self, round_, global_weights, uploads):
        x = self.server_payload(round_, -1, global_weights)["weights"]
        self.h, average = server_update(self.h, x, [u["weights"] for u in uploads], self.params.alpha,
                                        self.run.num_clients, self.mask)
        return average if self.params.evaluate == "average" else next_model(average, self.h, self.params.alpha)

    def server_state(self):
        return {"h": self.h}

    def load_server_state(self, state):
        if "h" not in state:
            raise ValueError(f"the checkpoint has no FedDyn server state h (keys: {sorted(state)})")
        self.h = state["h"]
