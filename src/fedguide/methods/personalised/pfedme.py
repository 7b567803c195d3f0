"""pFedMe (T. Dinh, Tran & Nguyen, NeurIPS 2020, "Personalized Federated Learning with Moreau Envelopes").

Each client's personalised model θ_i is the proximal point of its loss around its local copy w of the global
model, θ_i(w) = argmin_θ f_i(θ) + (λ/2)·||θ − w||², and w descends the Moreau envelope, whose gradient is
λ·(w − θ_i(w)). The official code (github.com/CharlieDinh/pFedMe) runs, on each client, R local steps
(``local_epochs``), each on one batch (``FLAlgorithms/users/userpFedMe.py`` L39-54):
    K times:  θ ← θ − η_p·(∇f_i(θ; b) + λ·(θ − w) + μ·θ)       (``pFedMeOptimizer.step``,
                                                              ``FLAlgorithms/optimizers/fedoptimizer.py`` L57-65)
    then:     w ← w − η·λ·(w − θ)                            (``userpFedMe.py`` L53-54)
θ and w both start the round at the global model (``userbase.py`` L38-41) and θ carries over from one local step
to the next (it is the model's own parameters). The client uploads w (``userpFedMe.py`` L58); the server averages
the uploads weighted by the clients' sizes and mixes the result with its previous model,
    x ← (1 − β)·x + β·Σ_i (n_i / n)·w_i                     (``FLAlgorithms/servers/serverbase.py`` L107-125).

Where it is expected to lose: on the global test set under the default ``global_eval: clients``, which scores
each client's θ, fitted to its own label mix, on every class. On ``configs/demo.yaml`` (Dir 0.1, seeds 0-2,
last-2) that is 17.22 ± 4.21 % against FedAvg's 60.51 %, −43.29 [−59.39, −27.19] points paired
(benchmarks/results/method_defaults/demo.md); on the clients' own test splits (``eval.mode: both``, seeds 1-2:
seed 0 diverged there, below) 51.13 ± 3.50 % against FedAvg's global model's 60.52 %, −9.23
(benchmarks/results/method_defaults/demo_personal.md), the one personalised method here below FedAvg on its own
clients' splits as well. Its global model x (``global_eval: server``) was 45.3 and 52.6 % on seeds 1 and 2, 11 points
below FedAvg rather than 43 (benchmarks/results/method_defaults/pfedme_stability.md). The released step sizes
also sit at the edge of stability on a CNN: the inner step is stable only where the loss's sharpness stays below
2/η_p − λ − μ ≈ 7.2 (FedAvg's SGD at lr 0.01 with momentum 0.9 tolerates 380), and seed 0 diverged in round 4
on one machine (every time) and finished on another; train.lr cannot give it FedAvg's effective step (at 0.1 the w step
η·λ = 1.5 overshoots and every seed diverged in round 1). Lower ``personal_lr`` where it diverges.

Defaults and decisions (the official ``main.py`` argparse defaults, L66-78, for the settings the method names):
- λ 15 (``lam``), K 5 (``inner_steps``), η_p 0.09 (``personal_lr``), β 1.0 (``beta``), and μ 0.001 (``mu``),
  the ``pFedMeOptimizer``'s own default (fedoptimizer.py L50), which ``UserpFedMe`` never overrides (L26): a small
  L2 pull on θ inside every inner step. η is ``train.lr`` (the official ``--learning_rate``, default 0.005).
  The official defaults of the run's settings are batch 20 and R = 20 local steps (``--local_epochs``).
- Local steps: ``train.local_steps`` when set (the official R), else ``train.epochs`` × ⌈n/B⌉, one step per batch
  of the epoch. Batches come one after another from shuffled passes over the client's data; the official loader
  does not shuffle (``userbase.py`` L26) and keeps its place across rounds.
- The steps are the rule above, plain: the run's optimiser settings (momentum, weight decay, Adam) do not apply,
  and its passes compute in fp32 whatever ``train.precision`` says.
- Personal models (``eval.mode: personal | both``): ``personal: theta`` (default): θ after the client's last local
  step, the paper's personalised model, kept in the client's disk state. The official code means to score it
  (``persionalized_model_bar``, ``evaluate_personalized_model``) but the list it keeps holds the model's own
  parameter objects, which ``update_parameters(self.local_model)`` (userpFedMe.py L58) overwrites with w, so what it
  scores is w after the local steps: ``personal: local``. A client that has not trained yet has the global model.
- The official server trains every client every round (``serverpFedMe.py`` L54) and aggregates the round's
  sample (L59-66); the models that reach the server are the same when the engine trains only the sampled
  clients (``clients.per_round``), which is what it does: a client's personal model is then the one of its last
  round, not refreshed every round.
- Global accuracy: ``global_eval: clients`` (default, the house's protocol for personalised methods): the mean
  over all clients of their personal models on the global test set; ``server``: the global model x (the official
  ``evaluate``, serverpFedMe.py L51).
- The official code aggregates parameters only (``add_parameters``); buffers (BatchNorm statistics), updated by the
  θ passes, are averaged and mixed with the parameters here.
- The reported training loss is f_i(θ; b) at the first inner step of each local step.
"""
from __future__ import annotations

import math
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from fedguide.core import simulated
from fedguide.core.aggregation import sample_weighted_average
from fedguide.core.training import has_batchnorm
from fedguide.methods._personalise import batch_at, client_batches, mean_client_metrics
from fedguide.methods.base import METHODS, Method


class PFedMeParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lam: float = Field(15.0, gt=0.0, description="λ: the Moreau envelope's regularisation (official --lamda 15)")
    inner_steps: int = Field(5, ge=1, description="K: steps of the inner problem for θ per local step (--K 5)")
    personal_lr: float = Field(0.09, gt=0.0, description="η_p: step size of the inner steps "
                                                         "(--personal_learning_rate 0.09)")
    beta: float = Field(1.0, gt=0.0, description="β: x ← (1 − β)·x + β·average (--beta 1.0)")
    mu: float = Field(0.001, ge=0.0, description="μ: the L2 term μ·θ of the inner step (pFedMeOptimizer's "
                                                 "default 0.001)")
    personal: Literal["theta", "local"] = Field(
        "theta", description="the personal model scored: theta = θ (the paper's); local = w after the local "
                             "steps (what the official code scores)")
    global_eval: Literal["clients", "server"] = Field(
        "clients", description="global accuracy: clients = the mean of the personal models on the global test "
                               "set; server = the global model")


def inner_step_(theta: list[torch.Tensor], grads: list[torch.Tensor], local: list[torch.Tensor],
                personal_lr: float, lam: float, mu: float) -> None:
    """θ ← θ − η_p·(∇f(θ) + λ·(θ − w) + μ·θ) in place (fedoptimizer.py L64)."""
    step = torch._foreach_sub(theta, local)
    torch._foreach_mul_(step, lam)
    torch._foreach_add_(step, grads)
    torch._foreach_add_(step, theta, alpha=mu)
    torch._foreach_add_(theta, step, alpha=-personal_lr)


def local_update_(local: list[torch.Tensor], theta: list[torch.Tensor], lr: float, lam: float) -> None:
    """w ← w − η·λ·(w − θ) in place (userpFedMe.py L53-54)."""
    torch._foreach_add_(local, torch._foreach_sub(local, theta), alpha=-lr * lam)


def server_mix(previous: torch.Tensor, average: torch.Tensor, beta: float) -> torch.Tensor:
    """x ← (1 − β)·x + β·average (serverbase.py L124-125)."""
    return (1.0 - beta) * previous + beta * average


@METHODS.register("pfedme", params=PFedMeParams)
class PFedMe(Method):
    """pFedMe: clients descend the Moreau envelope of their loss; θ_i, its proximal point, is the personal model."""

    paper = "https://arxiv.org/abs/2006.08848"

    def fit(self, model, ctx, train):
        p = self.params
        steps = train.local_steps or train.epochs * max(1, math.ceil(len(ctx.data) / train.batch_size))
        theta = [q for q in model.parameters() if q.requires_grad]
        local = [q.detach().clone() for q in theta]  # w, and θ, start at the global model
        # one shuffled pass after another, each pass's order copied to the device once
        stream = client_batches(ctx, train.batch_size, ctx.generator, 2 if has_batchnorm(model) else 1)
        model.train()
        total = torch.zeros((), device=ctx.device)  # summed where the run computes: no host read per step
        for _ in range(steps):
            ctx.batch_indices, kept = next(stream)  # a new pass copies its order to the device: not a step's work
            x, y = batch_at(ctx, ctx.batch_indices, kept)
            with simulated.step():
                for k in range(p.inner_steps):
                    loss = self.local_loss(model, x, y, ctx, None)
                    grads = torch.autograd.grad(loss, theta, allow_unused=True)
                    grads = [torch.zeros_like(q) if g is None else g for q, g in zip(theta, grads)]
                    with torch.no_grad():
                        inner_step_(theta, grads, local, p.personal_lr, p.lam, p.mu)
                    if k == 0:
                        total += loss.detach().float()
                with torch.no_grad():
                    local_update_(local, theta, train.lr, p.lam)
        if not torch.isfinite(total):
            raise FloatingPointError(f"client {ctx.client_id} diverged in round {ctx.round} (loss is {float(total)}); "
                                     "lower train.lr, method.personal_lr or method.lam")
        if p.personal == "theta":
            ctx.update_state(personal=self.run.layout.flatten(model))
        with torch.no_grad():  # the model uploads w (userpFedMe.py L58), with the buffers the θ passes left
            torch._foreach_copy_(theta, local)
        if p.personal == "local":
            ctx.update_state(personal=self.run.layout.flatten(model))
        ctx.steps = steps
        return float(total) / steps, None

    def aggregate(self, round_, global_weights, uploads):
        average = sample_weighted_average([u["weights"] for u in uploads], [u["num_samples"] for u in uploads])
        return server_mix(global_weights, average, self.params.beta)

    def personal_model(self, round_, client_id, global_weights):
        kept = self.run.store.get(client_id, round_).get("personal")
        return global_weights if kept is None else kept.to(self.run.device)

    def evaluate(self, round_, global_weights):
        if self.params.global_eval == "server":
            return self.run.evaluator.evaluate(global_weights)
        return mean_client_metrics(self.run, lambda cid: self.personal_model(round_, cid, global_weights))
