"""FedALA (Zhang, Hua, Wang, Song, Xue, Ma & Guan, AAAI 2023, "FedALA: Adaptive Local Aggregation for
Personalized Federated Learning"); released code github.com/TsingZ0/FedALA (``utils/ALA.py``).

Where it may lose: on the global test set. Its global accuracy (``global_eval: clients``) scores the clients'
personalised models there, each fitted to its own label mix. On ``configs/demo.yaml`` (Dir 0.1) with
``ala_clients: participants`` it was about 20 points below FedAvg's (seeds 0-1): a client's model is mixed
towards the global one only when it trains. With the default ``all`` every client is re-initialised from each
new global model before the evaluation, and on seeds 0-2 it came out 2.52 points below FedAvg (57.98 % vs
60.51 %, last-k, paired interval [−10.66, +5.61]; per seed −1.25, −0.08, −6.24), more than its own seed spread of
1.41 (benchmarks/results/method_defaults/demo.md): the mixing weights W_i pull each client's model towards its
own label mix, which the global test set does not share. Compare ``personal_accuracy`` under
``eval.mode: both``, where personalisation is meant to win: there the same runs score 86.99 ± 1.96 % against
FedAvg's global model's 60.52 % on the same splits, +26.47 [+22.79, +30.15]
(benchmarks/results/method_defaults/demo_personal.md).

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

Which clients (``ala_clients``): ``all`` (default), as the released server does: every round it sends the new
global model to every client, not only the round's participants, and each one initialises its local model with
ALA (``system/flcore/servers/serverALA.py`` L45 and L90-94, ``client.local_initialization``, then the
evaluation of L47-50, then the training of the selected clients, L52-53). Here the server does that for every
client when it has aggregated round r (θ_i ← θ̂_i(Θ_r), kept in the client's disk state with its W_i), and the
round's evaluation scores those models, the released evaluation's moment; a client chosen in round r + 1
starts from its θ̂_i without mixing again. Cost: every round runs ALA for every client, on the server, one
after another (the first time until convergence, bounded by ``first_max_epochs``), and reads and writes every
client's model in its disk state; it needs the clients' data and state on the server (local, pool and
flower-sim runtimes; refused in a deployment) and no server optimiser (the next global model must be the
aggregate ALA mixed in). ``participants``: only the round's clients initialise, in their own round (FedDW's
code: ``main.py`` L656-659 builds ``Local_Update_by_FedALA``, whose ``train`` runs the ALA, for the
participation list alone; fedguide's earlier behaviour).

Defaults from the released code: η = 1.0, s = 80 %, threshold 0.1, num_pre_loss 10; p = 1 layer (the code's
``layer_idx`` 2 counts parameter tensors: the last layer's weight and bias). Decisions:
- A layer is a module owning parameters, counted from the output (as FedPer's ``personal_layers``).
- The s % subset is drawn at random each round from (seed, round, client) and passed over in that order every
  epoch, whole batches of ``train.batch_size`` only (the code: a contiguous slice at a random offset, loaded
  without shuffling, ``drop_last=True`` until its commit b402ad8, ``drop_last=False`` since, ``utils/ALA.py``
  L74); a subset smaller than one batch is one batch. ``partial_batch: true`` keeps the subset's last short
  batch.
- An epoch's loss is its last batch's (the code's record).
- ``first_max_epochs`` 100 bounds the first weight training, which the code runs until convergence without
  a bound; null removes the bound.
- Buffers (batch statistics) come from the global model; ALA weighs parameters only.
- A client with no local model yet holds the run's initial model (the released ``clientALA.py`` L15 and FedDW's
  ``main.py`` L643-644 give every client a copy of it); ALA is skipped while the local model's first parameter
  tensor equals the global model's (``utils/ALA.py`` L82), as in round 1, where the client starts from Θ.
- Personalised model: the client's local model as it holds it after the round (``all``: after the round's
  ALA; ``participants``: after its last training). Global accuracy (``global_eval: clients``, FedDW's
  protocol): the mean over all clients of their local models on the global test set (a client that never
  trained counts with the initial model, as FedDW's ``inference_by_pFL`` scores it); ``global_eval: server``
  scores the server's averaged model instead.
- ``protocol: feddw``: FedDW's code (``Updata.py`` L761-854): ``ala_clients: participants``; the weights learn
  one pass, every time, over the client's whole training set shuffled (``trainloader_w``, L769, and the
  single loop of L805: ``rand_percent`` 80 is set, L771, but unused): ``rand_percent: 100``,
  ``first_max_epochs: 1``, ``partial_batch: true``; η 1.0 and ``layer_idx`` 2 as here; ``global_eval:
  clients`` (``main.py`` L677).
"""
from __future__ import annotations

from typing import Iterable, Literal, Optional

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, model_validator

from fedguide.core.device import to_device
from fedguide.core.seeding import torch_generator
from fedguide.core.state import ClientStateStore
from fedguide.methods._personalise import batch_at, mean_client_metrics, top_layers_start
from fedguide.methods.base import METHODS, ClientContext, Method
from fedguide.methods.personalised._protocol import Protocol, apply_protocol, protocol_field
from fedguide.methods.server_optimizers import ServerOptimizer
from fedguide.registry import ConfigError

ALA_TAG = 41  # the ALA subset's random stream, apart from the client's batch order
PRESETS = {"feddw": {"ala_clients": "participants", "rand_percent": 100.0, "first_max_epochs": 1,
                     "partial_batch": True, "eta": 1.0, "layers": 1, "global_eval": "clients"}}


class FedALAParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    protocol: Protocol = protocol_field()
    ala_clients: Literal["all", "participants"] = Field(
        "all", description="all: every client initialises with ALA every round (released server); participants: "
                           "only the round's clients (FedDW's code)")
    eta: float = Field(1.0, gt=0.0, description="η: learning rate of the aggregation weights")
    rand_percent: float = Field(80.0, gt=0.0, le=100.0, description="s: percent of the local data the weights learn on")
    layers: int = Field(1, ge=1, description="p: top layers whose aggregation is learned (the lower ones take the "
                                             "global model)")
    threshold: float = Field(0.1, gt=0.0, description="first weight training stops when the std of the last "
                                                      "num_pre_loss epoch losses is below this")
    num_pre_loss: int = Field(10, ge=2, description="epoch losses the convergence test looks at")
    first_max_epochs: Optional[int] = Field(100, ge=1, description="bound on the first weight training's epochs; "
                                                                   "null = until convergence")
    partial_batch: bool = Field(False, description="the weights also learn on the subset's last short batch")
    global_eval: Literal["clients", "server"] = Field(
        "clients", description="global accuracy: mean of all clients' local models, or the server's averaged model")

    @model_validator(mode="before")
    @classmethod
    def _protocol(cls, data):
        return apply_protocol(data, PRESETS)


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
        self._first: Optional[slice] = None  # the first parameter tensor: equal in both models, ALA is skipped
        offset = 0
        for name, shape in zip(run.layout.names, run.layout.shapes):
            n = int(torch.Size(shape).numel())
            if name in names and self._first is None:
                self._first = slice(offset, offset + n)
            if offset >= self._start and name in names:
                self._top.append((name, slice(offset, offset + n)))
            offset += n
        stepping = self.server_optimizer is not None and type(self.server_optimizer) is not ServerOptimizer
        if self.params.ala_clients == "all" and stepping:
            raise ConfigError("method.ala_clients: all mixes every client's model with the round's aggregate, which "
                              "a server optimiser replaces by its own step; remove server_optimizer or write "
                              "method.ala_clients: participants")

    def _batches(self, ctx: ClientContext) -> list:
        n = len(ctx.data)
        m = max(1, int(self.params.rand_percent / 100 * n))
        gen = torch_generator(self.run.seed, "client", ctx.round, ctx.client_id, ALA_TAG)
        subset = ctx.data.indices[torch.randperm(n, generator=gen)[:m]]
        size = self.run.train.batch_size
        last = m if self.params.partial_batch else m - size + 1
        whole = [subset[s: s + size] for s in range(0, last, size)] or [subset]
        return [batch_at(ctx, b) for b in whole]

    def _ala(self, ctx: ClientContext, glob: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        """θ̂: ``local`` mixed into the global model ``glob`` by weights learned on the client's data (ALA), the
        weights kept in ``ctx.state``; ``glob`` itself while the two models' first parameters agree."""
        model = self.run.model
        self.run.layout.load(model, glob)  # the lower layers and every buffer take Θ
        named = dict(model.named_parameters())
        params = [named[name] for name, _ in self._top]
        if torch.equal(local[self._first], glob[self._first]):
            return glob
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

    def _local(self, state: dict) -> torch.Tensor:
        local = state.get("weights")
        return self.run.initial_weights if local is None else local.to(self.run.device)

    def client_start(self, ctx):
        glob = ctx.payload["weights"]
        if ctx.state.get("ala_round") == ctx.round - 1:  # mixed with this very model by the server (all)
            return ctx.state["weights"]
        return self._ala(ctx, glob, self._local(ctx.state))

    def client_upload(self, model, ctx, state):
        upload = super().client_upload(model, ctx, state)
        ctx.update_state(weights=upload["weights"])
        return upload

    def aggregate(self, round_, global_weights, uploads):
        new = super().aggregate(round_, global_weights, uploads)
        if self.params.ala_clients == "all":
            self._initialise_every_client(round_, new)
        return new

    def _initialise_every_client(self, round_: int, glob: torch.Tensor) -> None:
        """Every client's θ̂ with the round's aggregate, as the next round's start and this round's scored model;
        the draws are those the client would make in round + 1, and the process's random state is kept."""
        run = self.run
        if not isinstance(run.store, ClientStateStore):
            raise ConfigError("method.ala_clients: all initialises every client's model on the server, which in a "
                              "deployment has neither their data nor their state; write method.ala_clients: "
                              "participants")
        with torch.random.fork_rng(devices=[]):
            for cid in range(run.num_clients):
                state = to_device(run.store.get(cid, round_), run.device)
                ctx = ClientContext(cid, round_ + 1, run.data.client(cid), {}, state, device_data=run.device_data)
                state["weights"] = self._ala(ctx, glob, self._local(state))
                state["ala_round"] = round_
                run.store.put(cid, round_, state)

    def personal_model(self, round_, client_id, global_weights):
        return self._local(self.run.store.get(client_id, round_))

    def evaluate(self, round_, global_weights):
        if self.params.global_eval == "server":
            return super().evaluate(round_, global_weights)
        return mean_client_metrics(self.run, lambda cid: self.personal_model(round_, cid, global_weights))
