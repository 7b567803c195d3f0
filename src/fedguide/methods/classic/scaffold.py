"""SCAFFOLD (Karimireddy et al., ICML 2020): control variates correct the client drift of local SGD.

Algorithm 1 of the paper, with option II for the client control variate:
- client i starts from the server model x, with the server control c and its own control c_i
  (zero before its first round) and takes K local steps on the corrected gradient
  y_i ← y_i − η_l (g_i(y_i) − c_i + c);
- c_i⁺ = c_i − c + (x − y_i) / (K·η_l) (option II); it uploads Δy_i = y_i − x and Δc_i = c_i⁺ − c_i
  and keeps c_i ← c_i⁺;
- server: x ← x + η_g · (1/|S|) Σ Δy_i and c ← c + (|S|/N) · (1/|S|) Σ Δc_i.

Decisions:
- The local steps use the run's optimiser (``local_momentum: null``): a method's name does not change the
  train settings it is compared under (``train.momentum: 0`` gives every method, SCAFFOLD included, Algorithm
  1's plain SGD; ``local_momentum: 0`` gives it to SCAFFOLD alone). ``train.lr`` stays η_l.
- The correction is applied as NIID-Bench does (``correction: step``; Li, Diao, Chen & He, ICDE 2022,
  github.com/Xtra-Computing/NIID-Bench, experiments.py ``train_net_scaffold`` L345-350 and L364, run there with
  SGD lr 0.01 and momentum 0.9 by its image-data-without-noise.sh script): the optimiser steps on the plain
  gradient and the weights then move by −η_l·(c − c_i), a plain step outside momentum and weight decay; the
  control update is option II's literal (x − y_i)/(K·η_l), so under momentum c_i is the mean step taken over
  η_l, the units the plain correction step needs (``momentum_correction`` does not apply). The step is
  applied in ``after_backward``, before the optimiser's rather than after it: the gradient is already taken,
  so the weights end the same, except that weight decay sees the moved weights (η_l²·λ·(c − c_i) per step).
  Under plain SGD the two forms are Algorithm 1 alike.
- Measured against FedAvg on the same optimiser (SGD lr 0.01, momentum 0.9), last-k, seeds 0-2, paired by
  seed: on ``configs/demo.yaml`` this default is 57.75 % against FedAvg's 60.51 % (−2.76 points, interval
  [−6.88, +1.36]), where the earlier default, plain local SGD whatever the config said, was 53.51 % (−6.99);
  on ``configs/fmnist_dir0.1.yaml`` at ``data.fraction=0.25`` it is 70.51 % against 75.75 % (−5.24, [−17.83,
  +7.35]; per seed +0.50, −9.10, −7.12), where plain local SGD was 64.80 % (−10.95)
  (benchmarks/results/scaffold_defaults.md). Where it is expected to lose: on short runs under strong label skew
  such as these (10-20 rounds of one local epoch, Dir 0.1), by more than its seed spread (2.15 and 3.01
  points). The likely reason, not measured apart: each c_i is one round old and estimated from a client's
  own skewed data, so early on its correction adds as much noise as it removes drift; the paper's and
  NIID-Bench's gains come over 50 or more rounds.
- ``correction: gradient`` adds c − c_i to the gradient through the local loss: we add ⟨w, c − c_i⟩ over
  the trainable parameters, whose gradient is exactly c − c_i, as (term − term.detach()), so the reported
  training loss stays the plain cross-entropy; the optimiser's momentum and weight decay then act on the
  corrected gradient. Under the shared FMNIST Dir(0.1) setting (momentum 0.9, lr 0.01, K from 2 to ~70
  steps by client size) this form oscillated and collapsed (10 % at round 16 on seed 1; plain SGD at lr 0.1,
  the same effective step, diverged to NaN): once a client fits its own data, its corrected step keeps
  moving it by about η_l·(c − c_i) per step, amplified by the momentum, and with unequal K these moves do not
  cancel in the mean.
- K = the optimizer steps actually taken this round (``ctx.steps``; ``train.local_steps`` gives every
  client the same K, as in Algorithm 1), η_l = ``train.lr``.
  ``momentum_correction`` (default on; matters only with momentum under ``correction: gradient``): with SGD
  momentum β > 0, the K steps move the weights by about η_l·m(K, β)·K·g for a constant gradient g, with
  m(K, β) = (1/K)·Σ_{k=1..K} (1 − β^k)/(1 − β); dividing by K·η_l alone would overestimate the
  gradient by up to 1/(1 − β) (10× at β = 0.9) and the over-sized correction makes training diverge.
  We therefore divide by K·η_l·m(K, β). For β = 0 m = 1 and this is the paper's formula exactly; set
  ``momentum_correction: false`` for the literal formula under momentum. With Adam there is no
  such factor (m = 1); option II is then only a heuristic.
- ``control: option1`` is the paper's other choice, c_i⁺ = ∇f_i(x): one extra gradient pass over the
  local data at the server model, before training.
- Control variates cover trainable parameters only; buffers (BatchNorm running statistics) are
  not SGD iterates and are averaged with sample weights as in FedAvg.
- ``weighting: uniform`` is the paper's (1/|S|) Σ Δy_i; ``samples`` weights Δy_i by client size.
  The control update is always the paper's (1/N) Σ Δc_i.
- c is server state (checkpointed, restored on resume) and part of every payload; c_i lives in
  the client's disk state.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Optional, Sequence

import torch
from pydantic import BaseModel, ConfigDict, Field

from fedguide.methods.base import METHODS, Method


class ScaffoldParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # What a run whose config.yaml predates ``correction`` ran (fl/run_folder.as_written_then): its resume goes on so.
    written_before: ClassVar[dict[str, Any]] = {"correction": "gradient"}
    server_lr: float = Field(1.0, gt=0.0, description="global step size η_g")
    weighting: Literal["uniform", "samples"] = Field(
        "uniform", description="mean of Δy over clients: uniform (paper) or sample-weighted")
    momentum_correction: bool = Field(
        True, description="divide option II by the momentum step factor m(K, β) (1 when momentum is 0)")
    local_momentum: Optional[float] = Field(
        None, ge=0.0, lt=1.0,
        description="SGD momentum of SCAFFOLD's local steps alone: null keeps train.momentum (every method's); 0 "
                    "is Algorithm 1's plain SGD")
    correction: Literal["gradient", "step"] = Field(
        "step", description="how c − c_i enters a local step: step (a plain step −η_l·(c − c_i) beside the "
                            "optimiser's; NIID-Bench's train_net_scaffold) or gradient (added to the gradient, so "
                            "through the optimiser's momentum and weight decay)")
    control: Literal["option2", "option1"] = Field(
        "option2", description="c_i update: option II (from the local step) or option I (a gradient "
                               "pass over the local data at the server model)")


def momentum_factor(steps: int, momentum: float) -> float:
    """m(K, β) = (1/K) Σ_{k=1..K} (1 − β^k)/(1 − β): the mean step length of heavy-ball SGD, in
    units of η_l·g, over K steps from a zero momentum buffer under a constant gradient g."""
    if steps <= 0 or momentum == 0.0:
        return 1.0
    b = momentum
    return 1.0 / (1.0 - b) - b * (1.0 - b ** steps) / (steps * (1.0 - b) ** 2)


def control_update(c_local: torch.Tensor, c_global: torch.Tensor, x: torch.Tensor, y: torch.Tensor,
                   steps: int, lr: float) -> torch.Tensor:
    """Option II of the paper's Algorithm 1: c_i⁺ = c_i − c + (x − y_i) / (K·η_l)."""
    if steps <= 0:
        return c_local.clone()  # no step was taken: nothing was learnt about the local gradient
    return c_local - c_global + (x - y) / (steps * lr)


def server_update(x: torch.Tensor, c: torch.Tensor, delta_ys: Sequence[torch.Tensor],
                  delta_cs: Sequence[torch.Tensor], num_samples: Sequence[int], num_clients: int,
                  param_mask: torch.Tensor, server_lr: float = 1.0,
                  weighting: str = "uniform") -> tuple[torch.Tensor, torch.Tensor]:
    """Server step of Algorithm 1: x ← x + η_g·mean(Δy), c ← c + (|S|/N)·mean(Δc).

    ``x`` and each Δy are full weight vectors; ``c`` and each Δc cover the entries where
    ``param_mask`` is True. Buffer entries of x become the sample-weighted mean of the clients'
    buffers x + Δy_i (FedAvg), whatever ``weighting`` says.
    """
    if not delta_ys:
        raise ValueError("cannot aggregate zero client updates")
    n = torch.as_tensor([float(s) for s in num_samples], dtype=torch.float64)
    sample_w = n / n.sum()
    mean_w = sample_w if weighting == "samples" else torch.full_like(sample_w, 1.0 / len(delta_ys))
    param_mask = param_mask.to(x.device)
    dy_params = torch.zeros(int(param_mask.sum()), dtype=torch.float64, device=x.device)
    dy_buffers = torch.zeros(int((~param_mask).sum()), dtype=torch.float64, device=x.device)
    dc_sum = torch.zeros_like(c, dtype=torch.float64)
    for dy, dc, wm, ws in zip(delta_ys, delta_cs, mean_w, sample_w):
        dy64 = dy.to(torch.float64)
        dy_params.add_(dy64[param_mask], alpha=float(wm))
        dy_buffers.add_(dy64[~param_mask], alpha=float(ws))
        dc_sum.add_(dc.to(torch.float64))
    x_new = x.to(torch.float64).clone()
    x_new[param_mask] += server_lr * dy_params
    x_new[~param_mask] += dy_buffers  # Σ w_i (x + Δy_i) = x + Σ w_i Δy_i
    # (|S|/N)·(1/|S|)·Σ Δc_i = (1/N)·Σ Δc_i
    c_new = c.to(torch.float64) + dc_sum / num_clients
    return x_new.to(x.dtype), c_new.to(c.dtype)


def correction_term(params: list[torch.Tensor], corrections: list[torch.Tensor]) -> torch.Tensor:
    """⟨w, c − c_i⟩ minus its own value: zero in the forward pass, gradient c − c_i per parameter."""
    dots = torch.stack([t.sum() for t in torch._foreach_mul(params, corrections)]).sum()
    return dots - dots.detach()


@dataclass
class ScaffoldRound:
    """A client's round: option I's gradient at the server model, and the (parameters, c − c_i) pairs of the
    correction term (None while c = c_i: plain local SGD)."""

    gradient_at_x: Optional[torch.Tensor]
    pairs: Optional[tuple[list[torch.Tensor], list[torch.Tensor]]] = None


@METHODS.register("scaffold", params=ScaffoldParams)
class Scaffold(Method):
    """SCAFFOLD: local steps on g − c_i + c, control variates updated by option II."""

    paper = "https://arxiv.org/abs/1910.06378"

    def __init__(self, params, run):
        super().__init__(params, run)
        self._mask: torch.Tensor | None = None
        self.control: torch.Tensor | None = None

    @property
    def mask(self) -> torch.Tensor:
        if self._mask is None:
            self._mask = self.run.layout.parameter_mask(self.run.model).to(self.run.device)
        return self._mask

    def _zeros(self) -> torch.Tensor:
        return torch.zeros(int(self.mask.sum()), dtype=torch.float32, device=self.run.device)

    def setup(self):
        self.control = self._zeros()

    def server_payload(self, round_, client_id, global_weights):
        return {"weights": global_weights, "control": self.control}

    def local_train(self, train):
        if self.params.local_momentum is None:
            return train
        return train.model_copy(update={"momentum": self.params.local_momentum})

    def begin_local(self, model, ctx) -> ScaffoldRound:
        state = ScaffoldRound(self._full_gradient(model, ctx) if self.params.control == "option1" else None)
        diff = ctx.payload["control"] - ctx.state.get("control", self._zeros())
        if not torch.any(diff):
            return state  # c = c_i (e.g. both zero in round 1): plain local SGD
        full = torch.zeros(self.run.layout.numel, dtype=diff.dtype, device=diff.device)
        full[self.mask] = diff
        named = dict(model.named_parameters())
        params, corrections, offset = [], [], 0
        for name, shape in zip(self.run.layout.names, self.run.layout.shapes):
            size = int(torch.Size(shape).numel())
            if name in named:
                params.append(named[name])
                corrections.append(full[offset: offset + size].view(shape))
            offset += size
        state.pairs = (params, corrections)
        return state

    def _full_gradient(self, model, ctx) -> torch.Tensor:
        """Option I: ∇f_i(x), the mean of the local objective's gradient over the client's data at the
        server model, batch by batch (weighted by batch size, so it equals the full-batch mean)."""
        data, bs = ctx.data, self.run.train.batch_size
        params = [p for p in model.parameters() if p.requires_grad]
        total = [torch.zeros_like(p) for p in params]
        for start in range(0, len(data), bs):
            idx = data.indices[start: start + bs]
            loss = super().local_loss(model, *ctx.batch(idx), ctx, None)
            grads = torch.autograd.grad(loss, params)
            torch._foreach_add_(total, grads, alpha=idx.numel() / len(data))
        named = dict(model.named_parameters())
        by_name = dict(zip([n for n, p in model.named_parameters() if p.requires_grad], total))
        parts = [by_name[n].reshape(-1) for n in self.run.layout.names if n in named]
        return torch.cat(parts) if parts else self._zeros()

    def local_loss(self, model, x, y, ctx, state: ScaffoldRound):
        loss = super().local_loss(model, x, y, ctx, state)
        if state.pairs is None or self.params.correction == "step":
            return loss
        return loss + correction_term(*state.pairs)

    def after_backward(self, model, ctx, state: ScaffoldRound) -> None:
        # correction: step. The weights move by −η_l·(c − c_i) before the optimiser's step rather than after it, as
        # NIID-Bench does: the gradient is already taken, so the result is the same (only weight decay sees the
        # moved weights, a difference of η_l²·λ·(c − c_i) per step).
        if state.pairs is None or self.params.correction != "step":
            return
        with torch.no_grad():
            torch._foreach_add_(state.pairs[0], state.pairs[1], alpha=-self.run.train.lr)  # local_train keeps lr

    def client_upload(self, model, ctx, state: ScaffoldRound):
        train = self.local_train(self.run.train)
        x, y = ctx.payload["weights"], self.run.layout.flatten(model)
        c_local = ctx.state.get("control", self._zeros())
        lr = train.lr
        # Under correction: step the control variates stay in the units of the steps taken (NIID-Bench's c_i is
        # the mean momentum step over η_l), the units its plain correction step needs: no momentum factor.
        if self.params.momentum_correction and self.params.correction == "gradient" and train.optimizer == "sgd":
            lr *= momentum_factor(ctx.steps, train.momentum)
        if self.params.control == "option1":
            c_new = state.gradient_at_x
        else:
            c_new = control_update(c_local, ctx.payload["control"], x[self.mask], y[self.mask], ctx.steps, lr)
        ctx.update_state(control=c_new)
        return {"delta_y": y - x, "delta_c": c_new - c_local, "num_samples": len(ctx.data)}

    def aggregate(self, round_, global_weights, uploads):
        x, self.control = server_update(
            global_weights, self.control, [u["delta_y"] for u in uploads], [u["delta_c"] for u in uploads],
            [u["num_samples"] for u in uploads], self.run.num_clients, self.mask,
            self.params.server_lr, self.params.weighting)
        return x

    def server_state(self):
        return {"control": self.control}

    def load_server_state(self, state):
        if "control" not in state:
            raise ValueError(f"the checkpoint has no SCAFFOLD server control variate (keys: {sorted(state)})")
        self.control = state["control"]
