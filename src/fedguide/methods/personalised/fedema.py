"""FedEMA (Zhuang, Wen, Zhang, ICLR 2022, "Divergence-aware Federated Self-Supervised Learning"): federated
BYOL whose clients blend the received global model into their own by a divergence-aware moving average.
A baseline of FedDifRC's Table 5 (self-supervised FL): no label is used in training, and the global encoder is
evaluated by a linear probe as FedEMA's released code evaluates it (``_linear_probe.py``: a linear layer trained
with Adam on the frozen features of the whole training set, EasyFL applications/fedssl/linear_evaluation.py;
``probe: sklearn`` the logistic-regression probe), also the evaluation of ``feddifrc self_supervised: true``.

Networks (BYOL): the online encoder is the run's encoder h followed by a projector MLP (d → hidden, BN, ReLU
→ projection_dim); a predictor MLP (projection_dim → hidden, BN, ReLU → projection_dim) sits on top. The
target encoder (h and projector) is an exponential moving average of the online one, updated after every
step, ξ ← m·ξ + (1 − m)·θ (``target_decay`` m = 0.99). Loss per batch, with two random views v1, v2 of each
image (``_ssl_views.py``), q = predictor(online(v)), t = target(v), all L2-normalised:
    L = mean_i (2 − 2⟨q1_i, t2_i⟩) + mean_i (2 − 2⟨q2_i, t1_i⟩).
The server averages the online encoder (h, projector) and the predictor by FedAvg.

Divergence-aware update (the paper's Eq. for FedEMA): when client k takes part again, its starting online
encoder and predictor are
    W_k ← μ·W_k^{prev} + (1 − μ)·W_g,        μ = min(λ_k·‖W_g − W_k^{prev}‖, 1),
with ‖·‖ the L2 distance of the online encoders' parameters. The autoscaler sets λ_k = τ / ‖W_g − W_k^{prev}‖
the first time the client blends (so that μ = τ then, ``tau`` 0.7: the released README's FedEMA command);
``scaler: λ`` fixes it instead (the README's constant-scaler command uses 1). A client's first
participation starts from the global online encoder and predictor and takes the global online encoder as
its target. The client keeps its last online networks, its target and λ_k in its state (on disk).

Sources and decisions:
- Paper and released code (EasyFL applications/fedssl: client.py ``dynamic_ema_online`` and
  ``dynamic_dapu``, model.py ``BYOLModel``, main.py). The code's "dynamic DAPU" predictor update works out to
  the same blend μ·local + (1 − μ)·global as the encoder's (both of its branches do), so one μ serves both.
- The divergence is the paper's ‖W_g − W_k^{prev}‖ over every online-encoder parameter (BN statistics
  excluded). The released code measures instead the distance its previous round moved the model, over
  convolution weights only, averaged per layer; with the autoscaler only the ratio of distances between
  rounds matters.
- Blending covers parameters; BatchNorm running statistics come from the global model (the code's moving
  average walks ``parameters()`` only).
- Sizes: ``projection_dim`` 2048 and ``hidden_dim`` 4096 (model.py, BYOL's); the predictor is the code's
  default two-layer MLP. BYOL's target network runs in training mode (BatchNorm on the batch), as the
  code's target encoder does inside the model.
- The server does not average target encoders: the released server does, but no FedEMA client reads the
  result (a returning client keeps its own target, a new one takes the global online encoder).
- The classification head of the run's model is neither trained nor used; it travels unchanged.
- The optimiser is the run's ``train`` section (the released main.py's: SGD lr 0.032 with cosine decay,
  momentum 0.9, wd 5e-4, batch 128, E = 5; under FedDifRC's Table 5 protocol the paper configs' SGD).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from fedguide.core.aggregation import sample_weighted_average
from fedguide.core.training import train_local
from fedguide.core.weights import WeightLayout
from fedguide.methods._linear_probe import LinearProbe, ProbeParams
from fedguide.methods.personalised._ssl_views import view
from fedguide.methods.base import METHODS, Method


class FedEMAParams(ProbeParams):
    model_config = ConfigDict(extra="forbid")
    tau: float = Field(0.7, ge=0.0, le=1.0, description="autoscaler target τ: μ on a client's first blend")
    scaler: Optional[float] = Field(None, gt=0.0, description="a constant λ instead of the autoscaler")
    target_decay: float = Field(0.99, ge=0.0, le=1.0, description="BYOL target EMA decay m")
    projection_dim: int = Field(2048, ge=1, description="projector and predictor output size (code: 2048)")
    hidden_dim: int = Field(4096, ge=1, description="projector and predictor hidden size (code: 4096)")
    flip: bool = Field(True, description="horizontal flips in the views (off for digits)")
    seed: int = Field(0, ge=0, description="seed of the projector and predictor initialisation")


def mlp(dim: int, out: int, hidden: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(dim, hidden), nn.BatchNorm1d(hidden), nn.ReLU(inplace=True), nn.Linear(hidden, out))


class Heads(nn.Module):
    """The projector and predictor of BYOL (what the run's SplitModel lacks)."""

    def __init__(self, dim: int, projection: int, hidden: int):
        super().__init__()
        self.projector = mlp(dim, projection, hidden)
        self.predictor = mlp(projection, projection, hidden)


class Online(nn.Module):
    """encoder → projector → predictor, on the run's live encoder (its parameters are trained in place)."""

    def __init__(self, encoder: nn.Module, heads: Heads):
        super().__init__()
        self.encoder, self.heads = encoder, heads

    def project(self, x: torch.Tensor) -> torch.Tensor:
        return self.heads.projector(self.encoder(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.heads.predictor(self.project(x))


def byol_loss(q1: torch.Tensor, q2: torch.Tensor, t1: torch.Tensor, t2: torch.Tensor) -> torch.Tensor:
    """mean(2 − 2 cos(q1, t2)) + mean(2 − 2 cos(q2, t1)); the targets carry no gradient."""
    def term(q, t):
        return (2 - 2 * (F.normalize(q, dim=-1) * F.normalize(t.detach(), dim=-1)).sum(-1)).mean()
    return term(q1, t2) + term(q2, t1)


@torch.no_grad()
def ema_update_(target: list[torch.Tensor], online: list[torch.Tensor], decay: float) -> None:
    """ξ ← m·ξ + (1 − m)·θ, in place."""
    torch._foreach_mul_(target, decay)
    torch._foreach_add_(target, online, alpha=1 - decay)


def divergence_aware_blend(local: torch.Tensor, global_: torch.Tensor, blend: torch.Tensor, measure: torch.Tensor,
                           scaler: Optional[float], tau: float) -> tuple[torch.Tensor, float, Optional[float]]:
    """(start weights, μ, λ): μ = min(λ·‖(global − local)[measure]‖, 1); the entries in ``blend`` become
    μ·local + (1 − μ)·global, the others stay global. λ = τ / distance when ``scaler`` is None (autoscaler)."""
    distance = float(torch.linalg.vector_norm((global_ - local)[measure]))
    if scaler is None:
        if distance == 0.0:  # nothing to blend, and no scale to learn from
            return global_.clone(), 0.0, None
        scaler = tau / distance
    mu = min(scaler * distance, 1.0)
    out = torch.where(blend, mu * local + (1 - mu) * global_, global_)
    return out, mu, scaler


@dataclass
class EMARound:
    """A client's round: the target networks, the (target, online) parameters the EMA moves, μ of the blend,
    and whether the online networks took a step the target has not followed yet."""

    target_net: Online
    pairs: tuple[list[torch.Tensor], list[torch.Tensor]]
    mu: float
    stepped: bool = False


@METHODS.register("fedema", params=FedEMAParams)
class FedEMA(Method):
    """FedEMA: federated BYOL, returning clients blend in the global model by a divergence-aware EMA; linear probe."""

    paper = "https://arxiv.org/abs/2204.04385"

    needs_client_labels = False
    personal_evaluation = False  # no classifier of its own: the linear probe scores the encoder

    def __init__(self, params, run):
        super().__init__(params, run)
        dim = int(run.model.feature_dim)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(params.seed)
            self.heads = Heads(dim, params.projection_dim, params.hidden_dim).to(run.device)
            self.target_heads = Heads(dim, params.projection_dim, params.hidden_dim).to(run.device)
        self.heads_layout = WeightLayout.of(self.heads)
        self.heads_global = self.heads_layout.flatten(self.heads)
        self._target_model = None
        self._probe = LinearProbe(run, params)
        self._mu = 0.0
        # Which entries of (split weights, heads) form the online encoder (divergence) and what is blended.
        model_params = run.layout.parameter_mask(run.model)
        encoder = torch.zeros_like(model_params)
        encoder[run.layout.span("encoder.")] = True
        heads_params = self.heads_layout.parameter_mask(self.heads)
        projector = torch.zeros_like(heads_params)
        projector[self.heads_layout.span("projector.")] = True
        self.blend_mask = torch.cat([model_params & encoder, heads_params]).to(run.device)
        self.measure_mask = torch.cat([model_params & encoder, heads_params & projector]).to(run.device)

    # ---- server ------------------------------------------------------------------------------------
    def server_payload(self, round_, client_id, global_weights):
        return {"weights": global_weights, "heads": self.heads_global}

    def aggregate(self, round_, global_weights, uploads):
        self.heads_global = sample_weighted_average([u["heads"] for u in uploads], [u["num_samples"] for u in uploads])
        self._mu = sum(float(u["ema_mu"]) for u in uploads) / len(uploads)
        return super().aggregate(round_, global_weights, uploads)

    def evaluate(self, round_, global_weights):
        # ema_mu: the round's mean μ over its clients (0 for a first participation: the global model)
        return {**self._probe(global_weights), "ema_mu": self._mu}

    def server_state(self):
        return {"heads": self.heads_global}

    def load_server_state(self, state):
        self.heads_global = state["heads"].to(self.run.device)

    # ---- client ------------------------------------------------------------------------------------
    def client_start(self, ctx):
        # The start blends the client's previous networks into the global ones, heads and target included: fit
        # does it, as the heads and the target are the round's state, not the model's.
        return ctx.payload["weights"]

    def _blend(self, ctx) -> tuple[torch.Tensor, torch.Tensor, float]:
        """(the start of the model and the heads, the target networks, μ) of this client's round."""
        p = self.params
        received = torch.cat([ctx.payload["weights"], ctx.payload["heads"]])
        previous = ctx.state.get("online")
        if previous is None:  # first participation: the global networks, the global online encoder as target
            start, mu, scaler = received, 0.0, None
            target = received
        else:
            start, mu, scaler = divergence_aware_blend(previous.to(received.device), received,
                                                       self.blend_mask.to(received.device),
                                                       self.measure_mask.to(received.device),
                                                       ctx.state.get("scaler", p.scaler), p.tau)
            target = ctx.state["target"]
        if scaler is not None and p.scaler is None and "scaler" not in ctx.state:
            ctx.update_state(scaler=scaler)
        return start, target, mu

    def _target(self, device) -> tuple[nn.Module, Heads]:
        if self._target_model is None:
            with torch.random.fork_rng(devices=[]):
                self._target_model = self.run.make_model()
            self._target_model.requires_grad_(False)
            self.target_heads.requires_grad_(False)
        return self._target_model.to(device), self.target_heads.to(device)

    def fit(self, model, ctx, train):
        device = next(model.parameters()).device
        start, vector, mu = self._blend(ctx)
        n = self.run.layout.numel
        self.run.layout.load(model, start[:n])
        self.heads_layout.load(self.heads, start[n:])
        self.heads.to(device)
        target, target_heads = self._target(device)
        vector = vector.to(device)
        self.run.layout.load(target, vector[:n])
        self.heads_layout.load(target_heads, vector[n:])
        online = Online(model.encoder, self.heads)
        state = EMARound(Online(target.encoder, target_heads),
                         ([p for p in target.encoder.parameters()] + list(target_heads.projector.parameters()),
                          [p for p in model.encoder.parameters()] + list(self.heads.projector.parameters())), mu)
        loss, ctx.steps = train_local(online, self, ctx, self.local_train(train), ctx.generator, state)
        return (loss if ctx.steps else None), state

    def local_loss(self, model, x, y, ctx, state: EMARound):
        target = state.target_net
        if state.stepped:  # the previous step's update of the online network reaches the target
            ema_update_(*state.pairs, self.params.target_decay)
        state.stepped = True
        v1, v2 = view(x, self.params.flip), view(x, self.params.flip)
        target.train()
        with torch.no_grad():
            t1, t2 = target.project(v1), target.project(v2)
        return byol_loss(model(v1), model(v2), t1, t2)

    def client_upload(self, model, ctx, state: EMARound):
        if ctx.steps:  # the last step's update reaches the target too
            ema_update_(*state.pairs, self.params.target_decay)
        weights = self.run.layout.flatten(model)
        heads = self.heads_layout.flatten(self.heads)
        target_net = state.target_net
        target = torch.cat([self.run.layout.flatten(self._target_model), self.heads_layout.flatten(target_net.heads)])
        ctx.update_state(online=torch.cat([weights, heads]), target=target)
        return {"weights": weights, "heads": heads, "num_samples": len(ctx.data), "ema_mu": state.mu}
