"""SemiFL (Diao, Ding & Tarokh 2021, "SemiFL: Semi-Supervised Federated Learning for Unlabeled Clients with
Alternate Training"), one of FedDISC's multi-round baselines (the FedDISC paper Table 1; 500 rounds there).
Its paper is not among the project's papers: this follows its core idea, checked against the structure of
its released code (read, not copied), on FedDISC's classifier (frozen image encoder + linear head, see
_head_federation).

Each round, alternately:
1. Server: supervised training of the global head on its labeled set (``server_epochs`` epochs, the
   ``train`` section's lr/momentum/batch size, gradient norm clipped to 1), then broadcast. This step
   closes the previous round (below); only round 1 starts with one of its own.
2. Client: hard pseudo-labels from the received head on its (un-augmented) images; those with confidence
   max softmax ≥ ``threshold`` (0.95) form the "fix" set. Loss per batch = CE(head(strong view), ŷ) on a
   batch of the fix set ("fix", FixMatch-style consistency) + ``mix_weight`` · MixUp loss ("mix"): the fix
   batch mixed with an equally large random batch of all the client's images (their hard pseudo-labels,
   confident or not), λ ~ Beta(``mixup_alpha``, ``mixup_alpha``) per batch,
   λ·CE(head(x̃), ŷ_fix) + (1−λ)·CE(head(x̃), ŷ_mix). ``train.epochs`` passes over the fix set; gradient
   norm clipped to 1. A client without a confident image sits the round out.
3. Server: the plain mean of the active clients' heads (uniform weights, as the released code), applied
   with global momentum: v ← β_g·v + (w − mean), w ← w − v (β_g = ``server_momentum``, 0.5), then step 1
   for the next round: supervised training on the labeled set. The round is evaluated after that step,
   as the released code does (train_classifier_ssfl.py: ``server.update`` then ``train_server`` then
   ``test``, every round), so a round's accuracy is that of the head the next round's clients receive.
   Round 1 also starts with a supervised step before its first payload: the released code's first
   clients get the untrained model, whose linear head on a frozen encoder gives no pseudo-label above
   the threshold, so round 1 would be idle.

Decisions forced by the frozen encoder: MixUp mixes features (the encoder is frozen and not linear, so this
is manifold MixUp); strong views come from a bank of ``strong_views`` strongly augmented copies per image
encoded once (see _augment); the weak view is the image itself. Static batch normalisation (sBN) has
nothing to act on in a linear head and is left out.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field

from fedguide.core.seeding import derive_seed
from fedguide.methods.frozen_encoder.heads._augment import strong_augment
from fedguide.methods.frozen_encoder._frozen_encoder import head_logits, sgd_steps
from fedguide.methods.frozen_encoder.heads._head_federation import HeadFederation, HeadParams
from fedguide.methods.base import METHODS

VIEW_TAG, MIX_TAG = 41, 42


class SemiFLParams(HeadParams):
    threshold: float = Field(0.95, ge=0.0, le=1.0, description="confidence a pseudo-label needs to enter the fix set")
    mixup_alpha: float = Field(0.75, gt=0.0, description="MixUp's Beta(α, α)")
    mix_weight: float = Field(1.0, ge=0.0, description="weight of the MixUp loss (0: fix loss only)")
    server_epochs: int = Field(5, ge=1, description="epochs of supervised server training per round")
    server_momentum: float = Field(0.5, ge=0.0, lt=1.0, description="β_g, global momentum of the server update")
    strong_views: int = Field(4, ge=1, description="strongly augmented copies per client image, encoded once")
    max_grad_norm: float = Field(1.0, gt=0.0, description="gradient norm clipping (released code: 1)")


def confident_pseudo_labels(logits: torch.Tensor, threshold: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(hard pseudo-labels, mask of max softmax ≥ threshold)."""
    conf, labels = F.softmax(logits.float(), dim=1).max(1)
    return labels, conf >= threshold


def mixup_loss(logits: torch.Tensor, y_a: torch.Tensor, y_b: torch.Tensor, lam: float) -> torch.Tensor:
    return lam * F.cross_entropy(logits, y_a) + (1 - lam) * F.cross_entropy(logits, y_b)


@METHODS.register("semifl", params=SemiFLParams)
class SemiFL(HeadFederation):
    """SemiFL: server supervised training alternating with client FixMatch + MixUp on pseudo-labels."""

    paper = "https://arxiv.org/abs/2106.01432"

    def setup(self):
        super().setup()
        self.momentum: dict | None = None
        self._warm_started = False

    def server_step(self, round_: int) -> None:
        """Step 1 of round ``round_``: supervised training of the global head on the labeled set."""
        _, x, y = self.labeled()
        self.head, _ = self._supervised(self.global_head(), x, y, self.server_generator(round_))

    def server_payload(self, round_, client_id, global_weights):
        if round_ == 1 and not self._warm_started:  # round 1 opens with its own step (module docstring)
            self.server_step(1)
            self._warm_started = True
        return super().server_payload(round_, client_id, global_weights)

    def aggregate(self, round_, global_weights, uploads):
        out = super().aggregate(round_, global_weights, uploads)
        self.server_step(round_ + 1)  # the next round's step 1, before this round is evaluated (released code)
        return out

    def _supervised(self, head, x, y, generator):
        t, p = self.run.train, self.params

        def ce(params, idx):
            return F.cross_entropy(head_logits(params, x[idx]), y[idx])

        trained, loss, _ = sgd_steps(head, len(x), p.server_epochs, t.batch_size, t.lr, t.momentum, t.weight_decay,
                                     generator, ce, max_grad_norm=p.max_grad_norm)
        return trained, loss

    def client_train(self, head, ctx):
        p, t = self.params, self.run.train
        x = self.client_features(ctx)
        with torch.no_grad():
            y_all, confident = confident_pseudo_labels(head_logits(head, x), p.threshold)
        fix = torch.nonzero(confident).flatten()
        if len(fix) == 0:
            return head, float("nan"), 0.0
        views = self.features.augmented_views(
            ctx.data.indices.numpy(), p.strong_views, strong_augment,
            derive_seed(self.run.seed, "client", 0, ctx.client_id, VIEW_TAG) % 2 ** 31)
        gen = self.client_generator(ctx)
        rng = np.random.default_rng(derive_seed(self.run.seed, "client", ctx.round, ctx.client_id, MIX_TAG))

        def loss_fn(params, pos):
            rows = fix[pos]
            pick = torch.randint(0, p.strong_views, (len(rows),), generator=gen)
            loss = F.cross_entropy(head_logits(params, views[pick, rows]), y_all[rows])
            if p.mix_weight > 0:
                other = torch.randint(0, len(x), (len(rows),), generator=gen)
                lam = float(rng.beta(p.mixup_alpha, p.mixup_alpha))
                mixed = lam * x[rows] + (1 - lam) * x[other]
                loss = loss + p.mix_weight * mixup_loss(head_logits(params, mixed), y_all[rows], y_all[other], lam)
            return loss

        trained, loss, _ = sgd_steps(head, len(fix), t.epochs, t.batch_size, t.lr, t.momentum, t.weight_decay, gen,
                                     loss_fn, max_grad_norm=p.max_grad_norm)
        return trained, loss, 1.0  # uniform weights over active clients

    def server_update(self, round_, uploads):
        mean = self.fedavg(uploads)
        head = self.global_head()
        if mean is None:
            return head
        delta = {k: head[k] - mean[k] for k in head}
        if self.momentum is None:
            self.momentum = {k: torch.zeros_like(v) for k, v in head.items()}
        self.momentum = {k: self.params.server_momentum * self.momentum[k] + delta[k] for k in head}
        return {k: head[k] - self.momentum[k] for k in head}

    def server_state(self):
        state = super().server_state()
        if self.momentum is not None:
            state.update(momentum_weight=self.momentum["weight"], momentum_bias=self.momentum["bias"])
        return state

    def load_server_state(self, state):
        super().load_server_state({k: v for k, v in state.items() if k.startswith("head_")})
        if "momentum_weight" in state:
            self.momentum = {"weight": state["momentum_weight"].clone(), "bias": state["momentum_bias"].clone()}
