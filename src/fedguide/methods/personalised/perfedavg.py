"""Per-FedAvg (Fallah, Mokhtari & Ozdaglar, NeurIPS 2020, "Personalized Federated Learning with Theoretical
Guarantees: A Model-Agnostic Meta-Learning Approach").

The federation learns a meta-model w whose one-step adaptation w − α∇f_i(w) suits every client: the local
objective is F_i(w) = f_i(w − α∇f_i(w)). Each local step (Algorithm 1) draws independent batches D, D′ (and
D″) of the client's data and
    w̃ = w − α ∇f_i(w; D)                                            (the adapted model)
    w ← w − β (I − α ∇²f_i(w; D″)) ∇f_i(w̃; D′)                      (the meta-gradient step)
``variant: fo`` (Per-FedAvg (FO)) drops the Hessian term: w ← w − β ∇f_i(w̃; D′). ``variant: hf``
(Per-FedAvg (HF)) replaces the Hessian-vector product by the finite difference
    ∇²f_i(w; D″) g ≈ [∇f_i(w + δg; D″) − ∇f_i(w − δg; D″)] / (2δ),   g = ∇f_i(w̃; D′).
The server averages the clients' w (FedAvg). Personalisation (the paper's evaluation): each client adapts the
global model with ``personal_steps`` step(s) of gradient descent of size α on its own training data.

Defaults and decisions:
- α = 0.01 and δ = 0.001 are chosen here (the paper sets them per experiment).
- β: the meta-gradient is applied by the ``train`` section's optimiser with learning rate β (``beta``, null =
  ``train.lr``), so the run's shared optimiser settings hold (FedDW runs every method with Adam); the paper's
  plain step w ← w − β·(meta-gradient) is ``train.optimizer: sgd, train.momentum: 0, train.weight_decay: 0``.
- Local steps per round: ``train.local_steps`` when set, else ``train.epochs`` × ⌈n / (k·B)⌉ with k = 2 (fo)
  or 3 (hf) batches a step, so an epoch draws about as many samples as one pass over the data. The batches
  come one after another from shuffled passes over the client's data (a pass's last batch is short).
- The reported training loss is f_i(w; D), the loss of the first batch of each step before adaptation.
- Global accuracy (FedDW's protocol, the server's model): the meta-model w on the global test set, unadapted.
"""
from __future__ import annotations

import math
from typing import Callable, Literal, Optional, Sequence

import torch
from pydantic import BaseModel, ConfigDict, Field

from fedguide.core import simulated
from fedguide.core.seeding import torch_generator
from fedguide.core.training import has_batchnorm, make_optimizer
from fedguide.methods._personalise import batch_at, batch_stream
from fedguide.methods.base import METHODS, ClientContext, Method

Loss = Callable[[object], torch.Tensor]  # batch -> scalar loss at the parameters' current values


class PerFedAvgParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    variant: Literal["fo", "hf"] = Field("fo", description="fo: first-order; hf: Hessian-free (finite-difference "
                                                           "Hessian-vector product)")
    alpha: float = Field(0.01, gt=0.0, description="α: step size of the one-step adaptation (training and "
                                                   "personalisation)")
    beta: Optional[float] = Field(None, gt=0.0, description="β: learning rate of the meta step; null = train.lr")
    delta: float = Field(0.001, gt=0.0, description="δ: finite-difference step of the hf variant")
    personal_steps: int = Field(1, ge=1, description="personalisation: gradient steps of size α from the global model")


def meta_gradient(params: Sequence[torch.Tensor], loss: Loss, batches: Sequence, alpha: float, variant: str,
                  delta: float) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Per-FedAvg's meta-gradient at the current ``params`` (left unchanged) from ``batches`` = (D, D′) for
    ``fo`` or (D, D′, D″) for ``hf``: ∇f(w̃; D′), minus α times the finite-difference Hessian-vector product
    for ``hf``. Returns it with f(w; D)."""
    w = [p.detach().clone() for p in params]

    def grad_at(values: list[torch.Tensor], batch) -> tuple[list[torch.Tensor], torch.Tensor]:
        with torch.no_grad():
            for p, v in zip(params, values):
                p.copy_(v)
        value = loss(batch)
        return [g.detach() for g in torch.autograd.grad(value, params)], value.detach()

    try:
        g_inner, f_w = grad_at(w, batches[0])
        g, _ = grad_at([wi - alpha * gi for wi, gi in zip(w, g_inner)], batches[1])
        if variant == "hf":
            g_plus, _ = grad_at([wi + delta * gi for wi, gi in zip(w, g)], batches[2])
            g_minus, _ = grad_at([wi - delta * gi for wi, gi in zip(w, g)], batches[2])
            g = [gi - alpha * (gp - gm) / (2 * delta) for gi, gp, gm in zip(g, g_plus, g_minus)]
    finally:
        with torch.no_grad():
            for p, v in zip(params, w):
                p.copy_(v)
    return g, f_w


@METHODS.register("perfedavg", params=PerFedAvgParams)
class PerFedAvg(Method):
    """Per-FedAvg: FedAvg of a meta-model trained for one-step adaptation (first-order or Hessian-free)."""

    paper = "https://arxiv.org/abs/2002.07948"

    def fit(self, model, ctx, train):
        p = self.params
        per_step = 2 if p.variant == "fo" else 3
        steps = train.local_steps or train.epochs * max(1, math.ceil(len(ctx.data) / (per_step * train.batch_size)))
        optimizer = make_optimizer(model, train.model_copy(update={"lr": p.beta or train.lr}))
        params = [q for q in model.parameters() if q.requires_grad]
        stream = batch_stream(ctx.data.indices, train.batch_size, ctx.generator, 2 if has_batchnorm(model) else 1)
        model.train()

        def loss(batch):
            ctx.batch_indices = batch
            return self.local_loss(model, *batch_at(ctx, batch), ctx, None)

        total = torch.zeros((), device=ctx.device)  # summed on the device: no host read per step
        for _ in range(steps):
            with simulated.step():
                meta, f_w = meta_gradient(params, loss, [next(stream) for _ in range(per_step)], p.alpha, p.variant,
                                          p.delta)
                for q, g in zip(params, meta):
                    q.grad = g
                optimizer.step()
                total += f_w.float()
        if not torch.isfinite(total):
            raise FloatingPointError(f"client {ctx.client_id} diverged in round {ctx.round} (loss is {float(total)}); "
                                     "lower train.lr, method.beta or method.alpha")
        ctx.steps = steps
        return float(total) / steps, None

    def personal_model(self, round_, client_id, global_weights):
        run = self.run
        model = run.model
        run.layout.load(model, global_weights)
        model.train()
        params = [q for q in model.parameters() if q.requires_grad]
        ctx = ClientContext(client_id, round_, run.data.client(client_id), {}, {}, device_data=run.device_data)
        stream = batch_stream(ctx.data.indices, run.train.batch_size,
                              torch_generator(run.seed, "personal", round_, client_id),
                              2 if has_batchnorm(model) else 1)
        with torch.random.fork_rng(devices=[]):
            for _ in range(self.params.personal_steps):
                x, y = batch_at(ctx, next(stream))
                grads = torch.autograd.grad(self.local_loss(model, x, y, ctx, None), params)
                with torch.no_grad():
                    for q, g in zip(params, grads):
                        q.sub_(self.params.alpha * g)
        model.eval()
        return run.layout.flatten(model)
