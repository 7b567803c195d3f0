"""FedALA (Zhang, Hua, Wang, Song, Xue, Ma & Guan, AAAI 2023, "FedALA: Adaptive Local Aggregation for
Personalized Federated Learning"); released code github.com/TsingZ0/FedALA (``utils/ALA.py``).

Where it is expected to lose: on the global test set. Its global accuracy (``global_eval: clients``) scores
the clients' personalised models there, each fitted to its own label mix: on ``configs/demo.yaml`` (Dir 0.1)
it is about 20 points below FedAvg's (seeds 0-1, benchmarks/results/method_defaults/demo.md). Compare
``personal_accuracy`` under ``eval.mode: both``, where personalisation is meant to win.

Each client keeps its local model θ_i. Before local training it initialises from the received global model Θ
with Adaptive Local Aggregation (ALA, Algorithm 1 lines 6-16):
    θ̂_i = θ_i + (Θ − θ_i) ⊙ W_i,
where the lower layers take Θ outright (W = 1) and only the top p layers (``layers``) get learned element-wise
weights W_i ∈ [0, 1]. W_i is learned on a random s % (``rand_percent``) of the local data, per batch:
    W_i ← clip(W_i − η · ∇_θ̂ L(θ̂_i) ⊙ (Θ − θ_i), 0, 1),   then θ̂_i is recomputed from the new W_i,
starting from W_i = 1 (θ̂ = Θ) the first time and from the client's previous W_i after that. The first time
the weights train until the standard deviation of the last ``num_pre_loss`` epoch losses is below
``threshold``; later rounds train them one epoch. The client then trains θ̂_i with the run's local loop,
keeps the result as θ_i and uploads it; the server averages the uploads (FedAvg).

Defaults from the released code: η = 1.0, s = 80 %, threshold 0.1, num_pre_loss 10; p = 1 layer (the code's
``layer_idx`` 2 counts parameter tensors: the last layer's weight and bias). Decisions:
- A layer is a module owning parameters, counted from the output (as FedPer's ``personal_layers``).
- The s % subset is drawn at random each round from (seed, round, client) and passed over in that order every
  epoch, whole batches of ``train.batch_size`` only (the code: a contiguous slice at a random offset, loaded
  without shuffling, ``drop_last``); a subset smaller than one batch is one batch.
- An epoch's loss is its last batch's (the code's record).
- ``first_max_epochs`` 100 bounds the first weight training, which the code runs until convergence without
  a bound; null removes the bound.
- Buffers (batch statistics) come from the global model; ALA weighs parameters only.
- A client with no local model yet (its first round) starts from Θ: the code skips ALA when the local and
  global models coincide, which they do in round 1.
- Personalised model: the client's local model after its last training. Global accuracy
  (``global_eval: clients``, FedDW's protocol): the mean over all clients of their local models on the global
  test set (a client that never trained counts with the global model); ``global_eval: server`` scores the
  server's averaged model instead.
"""
from __future__ import annotations

from typing import Iterable, Literal, Optional

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field

from fedguide.core.seeding import torch_generator
from fedguide.methods._personalise import batch_at, mean_client_metrics, top_layers_start
from fedguide.methods.base import METHODS, ClientContext, Method

ALA_TAG = 41  # the ALA subset's random stream, apart from the client's batch order


class FedALAParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    eta: float = Field(1.0, gt=0.0, description="η: learning rate of the aggregation weights")
    rand_percent: float = Field(80.0, gt=0.0, le=100.0, description="s: percent of the local data the weights learn on")
    layers: int = Field(1, ge=1, description="p: top layers whose aggregation is learned (the lower ones take the "
                                             "global model)")
    threshold: float = Field(0.1, gt=0.0, description="first weight training stops when the std of the last "
                                                      "num_pre_loss epoch losses is below this")
    num_pre_loss: int = Field(10, ge=2, description="epoch losses the convergence test looks at")
    first_max_epochs: Optional[int] = Field(100, ge=1, description="bound on the first weight training's epochs; "
                                                                   "null = until convergence")
    global_eval: Literal["clients", "server"] = Field(
        "clients", description="global accuracy: mean of all clients' local models, or the server's averaged model")


def ala_update(grads: list[torch.Tensor], local: list[torch.Tensor], glob: list[torch.Tensor],
               weights: list[torch.Tensor], eta: float) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """One ALA step: (new weights W' = clip(W − η·g ⊙ (Θ − θ), 0, 1), new θ̂ = θ + (Θ − θ) ⊙ W')."""
    new_w = [torch.clamp(w - eta * g * (tg - tl), 0, 1) for g, tl, tg, w in zip(grads, local, glob, weights)]
    return new_w, [tl + (tg - tl) * w for tl, tg, w in zip(local, glob, new_w)]


def learn_weights(model: torch.nn.Module, params: list[torch.nn.Parameter], local: list[torch.Tensor],
                  glob: list[torch.Tensor], weights: list[torch.Tensor], batches: Iterable, eta: float,
                  converge: bool, max_epochs: Optional[int], threshold: float, num_pre_loss: int
                  ) -> list[torch.Tensor]:
    """Train the aggregation weights of ``params`` (the top layers of ``model``, whose lower layers already
    hold Θ): until the last ``num_pre_loss`` epoch losses have a std below ``threshold`` when ``converge``
    (at most ``max_epochs``, None: no bound), else ``max_epochs`` epochs. Returns the weights, leaving θ̂ in
    ``params``."""
    batches = list(batches)
    with torch.no_grad():
        for p, tl, tg, w in zip(params, local, glob, weights):
            p.copy_(tl + (tg - tl) * w)
    losses: list[float] = []
    while True:
        for x, y in batches:
            loss = F.cross_entropy(model(x), y)
            grads = torch.autograd.grad(loss, params)
            weights, mixed = ala_update(list(grads), local, glob, weights, eta)
            with torch.no_grad():
                for p, m in zip(params, mixed):
                    p.copy_(m)
        losses.append(float(loss.detach()))
        if max_epochs is not None and len(losses) >= max_epochs:
            return weights
        if converge and len(losses) > num_pre_loss and np.std(losses[-num_pre_loss:]) < threshold:
            return weights


@METHODS.register("fedala", params=FedALAParams)
class FedALA(Method):
    """FedALA: the received model is mixed into the local one with learned element-wise weights (ALA)."""

    paper = "https://arxiv.org/abs/2212.01197"

    def setup(self) -> None:
        run = self.run
        self._start = top_layers_start(run.layout, run.model, self.params.layers, "layers")
        names = dict(run.model.named_parameters())
        # The top layers' parameters in flat-vector order, with their ranges.
        self._top: list[tuple[str, slice]] = []
        offset = 0
        for name, shape in zip(run.layout.names, run.layout.shapes):
            n = int(torch.Size(shape).numel())
            if offset >= self._start and name in names:
                self._top.append((name, slice(offset, offset + n)))
            offset += n

    def _batches(self, ctx: ClientContext) -> list:
        n = len(ctx.data)
        m = max(1, int(self.params.rand_percent / 100 * n))
        gen = torch_generator(self.run.seed, "client", ctx.round, ctx.client_id, ALA_TAG)
        subset = ctx.data.indices[torch.randperm(n, generator=gen)[:m]]
        size = self.run.train.batch_size
        whole = [subset[s: s + size] for s in range(0, m - size + 1, size)] or [subset]
        return [batch_at(ctx, b) for b in whole]

    def client_start(self, ctx):
        glob, local = ctx.payload["weights"], ctx.state.get("weights")
        if local is None:
            return glob
        model = self.run.model
        self.run.layout.load(model, glob)  # the lower layers and every buffer take Θ
        named = dict(model.named_parameters())
        params = [named[name] for name, _ in self._top]
        tl = [local[s].view_as(p) for (_, s), p in zip(self._top, params)]
        tg = [glob[s].view_as(p) for (_, s), p in zip(self._top, params)]
        first = "ala_weights" not in ctx.state
        if first:
            weights = [torch.ones_like(p) for p in params]
        else:
            weights = [ctx.state["ala_weights"][s.start - self._start: s.stop - self._start].view_as(p)
                       for (_, s), p in zip(self._top, params)]
        others = [p for p in model.parameters() if all(p is not q for q in params)]
        for p in others:
            p.requires_grad_(False)
        model.train()
        try:
            weights = learn_weights(model, params, tl, tg, weights, self._batches(ctx), self.params.eta,
                                    converge=first, max_epochs=self.params.first_max_epochs if first else 1,
                                    threshold=self.params.threshold, num_pre_loss=self.params.num_pre_loss)
        finally:
            for p in others:
                p.requires_grad_(True)
        # θ̂: the global vector (lower layers, buffers) with the learned mix in the top layers' parameters.
        mixed = glob.clone()
        packed = torch.ones(self.run.layout.numel - self._start, device=glob.device)
        for (_, s), w, p in zip(self._top, weights, params):
            mixed[s] = p.detach().reshape(-1)
            packed[s.start - self._start: s.stop - self._start] = w.reshape(-1)
        ctx.update_state(ala_weights=packed)
        return mixed

    def client_upload(self, model, ctx, state):
        upload = super().client_upload(model, ctx, state)
        ctx.update_state(weights=upload["weights"])
        return upload

    def personal_model(self, round_, client_id, global_weights):
        local = self.run.store.get(client_id, round_).get("weights")
        return global_weights if local is None else local.to(self.run.device)

    def evaluate(self, round_, global_weights):
        if self.params.global_eval == "server":
            return super().evaluate(round_, global_weights)
        return mean_client_metrics(self.run, lambda cid: self.personal_model(round_, cid, global_weights))
