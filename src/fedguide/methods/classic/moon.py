"""MOON (Li, He, Song, CVPR 2021): model-contrastive federated learning.

Local objective (the paper's model-contrastive loss): ℓ = CE(g(h(x)), y) + μ·ℓ_con with

    ℓ_con = −log( exp(sim(z, z_glob)/τ) / (exp(sim(z, z_glob)/τ) + exp(sim(z, z_prev)/τ)) ),

sim = cosine similarity; z from the model being trained, z_glob from the frozen global model the
client received, z_prev from the frozen local model this client produced the last time it took part
(one previous model: the paper's buffer size 1). Server: FedAvg.

Decisions (see the method's entry in the README):
- Representation: z is the encoder output h(x) of the shared split model. The paper's extra
  projection head (two-layer MLP on top of the encoder) is not added: it would change the
  architecture every other method shares and communicates.
- A client's first participation has no previous local model. The released code then has an empty
  model pool, so the contrastive logits hold only the positive and ℓ_con = 0 (its first round is
  plain FedAvg). Using the global model as the previous one instead gives z_prev = z_glob and
  ℓ_con = log 2 with zero gradient: the same training. fedguide skips the term (and the two frozen
  forward passes) in that case, exactly as the released code.
- The previous model lives in the client's disk-backed state (``prev_weights``); the released code
  keeps every client's last model in memory and, with partial participation, also uses the stale
  weights of clients that did not train in the last round — here it is always this client's own
  last local model, from whichever round it last took part in.
- Both frozen models are built once per process and loaded per client; they run in eval mode (BN
  running statistics, as the released code's ``global_model.eval()``) without gradients.
- Defaults μ = 1.0 (FedDifRC's tuned value; also the released code's default) and τ = 0.5 (the
  paper's and the released code's).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field

from fedguide.methods.base import METHODS, Method
from fedguide.models.split import SplitModel


class MoonParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    mu: float = Field(1.0, ge=0.0, description="weight of the model-contrastive term")
    tau: float = Field(0.5, gt=0.0, description="temperature of the model-contrastive term")


def moon_contrastive_loss(z: torch.Tensor, z_glob: torch.Tensor, z_prev: torch.Tensor, tau: float) -> torch.Tensor:
    """Batch mean of −log(e^{sim(z,z_glob)/τ} / (e^{sim(z,z_glob)/τ} + e^{sim(z,z_prev)/τ})), cosine sim."""
    pos = F.cosine_similarity(z, z_glob, dim=-1) / tau
    neg = F.cosine_similarity(z, z_prev, dim=-1) / tau
    # −log(e^p / (e^p + e^n)) = log(1 + e^(n − p)) = softplus(n − p), computed stably.
    return F.softplus(neg - pos).mean()


def _frozen_copy(run) -> SplitModel:
    # Building a model draws its initialisation from torch's global RNG; fork it so that creating the
    # frozen models (lazily, in whichever client comes first) leaves every random stream untouched.
    with torch.random.fork_rng(devices=[]):
        model = run.make_model()
    model.eval()
    model.requires_grad_(False)
    return model


@dataclass
class MoonRound:
    """A client's round after its first participation: the frozen global and previous local models."""

    glob: SplitModel
    prev: SplitModel


@METHODS.register("moon", params=MoonParams)
class Moon(Method):
    """MOON: CE + mu·contrast(z vs global model's z, previous local model's z), FedAvg aggregation."""

    paper = "https://arxiv.org/abs/2103.16257"

    def __init__(self, params, run):
        super().__init__(params, run)
        self._glob: SplitModel | None = None
        self._prev: SplitModel | None = None

    def _frozen_models(self, like: SplitModel) -> tuple[SplitModel, SplitModel]:
        if self._glob is None or self._prev is None:
            self._glob, self._prev = _frozen_copy(self.run), _frozen_copy(self.run)
        device = next(like.parameters()).device
        return self._glob.to(device), self._prev.to(device)

    def begin_local(self, model, ctx) -> Optional[MoonRound]:
        previous = ctx.state.get("prev_weights")
        if self.params.mu == 0 or previous is None:
            return None  # first participation (or mu = 0): plain cross-entropy
        glob, prev = self._frozen_models(model)
        self.run.layout.load(glob, ctx.payload["weights"])
        self.run.layout.load(prev, previous)
        return MoonRound(glob, prev)

    def local_loss(self, model, x, y, ctx, state: Optional[MoonRound]):
        if state is None:
            return super().local_loss(model, x, y, ctx, state)
        glob, prev = state.glob, state.prev
        z, logits = model.forward_features(x)
        with torch.no_grad():
            z_glob, z_prev = glob.encoder(x), prev.encoder(x)
        return F.cross_entropy(logits, y) + self.params.mu * moon_contrastive_loss(z, z_glob, z_prev, self.params.tau)

    def client_upload(self, model, ctx, state):
        upload = super().client_upload(model, ctx, state)
        if self.params.mu > 0:
            ctx.update_state(prev_weights=upload["weights"])
        return upload
