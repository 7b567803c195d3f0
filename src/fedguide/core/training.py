"""The default local training loop (``Method.fit``): mini-batches gathered by index from the shared
in-memory tensors, the method's ``local_loss`` per batch.

It knows the method only by its hooks (``local_loss``, ``after_backward``, ``local_optimizers``, each
given the round's state that the caller got from ``begin_local``), the regularisers it is trained with
(``regularizers``: each one's ``loss`` joins the objective) and the train settings only by their fields
(``epochs``, ``local_steps``, ``batch_size``, optimiser keys), so
it sits below the methods and the config that use it.
"""
from __future__ import annotations

import itertools
from typing import Any

import torch

from fedguide.core import simulated
from fedguide.core.device import autocast


def make_optimizer(model: torch.nn.Module, cfg: Any) -> torch.optim.Optimizer:
    if cfg.optimizer == "adam":
        return torch.optim.Adam(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    return torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)


def _has_grads(optimizer: torch.optim.Optimizer) -> bool:
    return any(p.grad is not None for group in optimizer.param_groups for p in group["params"])


def _backward_and_step(loss: torch.Tensor, model: torch.nn.Module, method: Any, ctx: Any, state: Any,
                       optimizer: torch.optim.Optimizer, owned: list[torch.optim.Optimizer],
                       scaler: "torch.amp.GradScaler | None") -> None:
    """Backward, the method's gradient edits, the model's step and the method's own optimisers' steps (each where
    this step gave its parameters a gradient: a look at .grad on the host, no device value read)."""
    optimizer.zero_grad(set_to_none=True)
    if scaler is None:
        loss.backward()
        method.after_backward(model, ctx, state)
        optimizer.step()
        for o in owned:
            if _has_grads(o):
                o.step()
            o.zero_grad(set_to_none=True)
        return
    scaler.scale(loss).backward()
    stepping = (optimizer, *[o for o in owned if _has_grads(o)])
    for o in stepping:
        scaler.unscale_(o)  # a method's gradient edits see the true gradients
    method.after_backward(model, ctx, state)
    for o in stepping:
        scaler.step(o)  # skipped, each of them, when this step's gradients overflowed
    for o in owned:
        o.zero_grad(set_to_none=True)
    scaler.update()


def regularizer_terms(method: Any, ctx: Any) -> list[tuple[Any, dict]]:
    """(regulariser, its part of the client's payload) for each regulariser ``method`` is trained with."""
    return [(r, r.own(ctx.payload)) for r in getattr(method, "regularizers", ())]


def local_objective(method: Any, terms: list[tuple[Any, dict]], model: torch.nn.Module, x: torch.Tensor,
                    y: torch.Tensor, ctx: Any, state: Any) -> torch.Tensor:
    """The method's ``local_loss`` on one batch plus each regulariser's term."""
    loss = method.local_loss(model, x, y, ctx, state)
    for r, payload in terms:
        loss = loss + r.loss(model, x, y, ctx, payload)
    return loss


def has_batchnorm(model: torch.nn.Module) -> bool:
    return any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())


def train_local(model: torch.nn.Module, method: Any, ctx: Any, cfg: Any, generator: torch.Generator,
                state: Any = None, optimizer: "torch.optim.Optimizer | None" = None) -> tuple[float, int]:
    """Run ``cfg.epochs`` epochs (or exactly ``cfg.local_steps`` steps) of the method's local
    objective on the round's ``state`` (what ``method.begin_local`` returned, called by the caller with the
    model in training mode); returns (mean loss, steps). ``optimizer``: one the caller keeps across several
    calls (FedRep's head and body phases under one optimiser), else a fresh one from ``cfg``.

    Batches come from ``ctx.device_data`` (the run's tensors where it computes, augmented with
    ``train.augment``) or, without it, are gathered from the client's host tensors. ``ctx.batch_indices``
    always holds the batch's host indices, for methods that look up per-sample features.
    """
    data, feed = ctx.data, getattr(ctx, "device_data", None)
    n = len(data)
    optimizer = optimizer if optimizer is not None else make_optimizer(model, cfg)
    model.train()
    # Optimisers of parameters the method owns beside the model's (Method.local_optimizers), built in begin_local.
    owned = list(method.local_optimizers(ctx, state)) if hasattr(method, "local_optimizers") else []
    terms = regularizer_terms(method, ctx)
    precision = getattr(cfg, "precision", "fp32")
    channels_last = getattr(cfg, "channels_last", False)
    device = feed.device if feed is not None else data.x.device
    # fp16 gradients underflow without scaling; bf16 keeps fp32's exponent range and needs none.
    scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None
    # BatchNorm cannot normalise a batch of one sample; such a trailing batch is skipped.
    min_batch = 2 if has_batchnorm(model) else 1
    loss_sum = torch.zeros((), device=device)
    steps = 0
    budget = cfg.local_steps
    for epoch in itertools.count():
        if (epoch >= cfg.epochs) if budget is None else (steps >= budget or (epoch > 0 and steps == 0)):
            break
        order = data.indices[torch.randperm(n, generator=generator)]
        # One copy of the order per epoch to where the tensors are kept, none per batch.
        kept = feed.indices(order) if feed is not None else order.to(data.x.device, non_blocking=True)
        for start in range(0, n, cfg.batch_size):
            batch = order[start: start + cfg.batch_size]
            if budget is not None and steps >= budget:
                break
            if batch.numel() < min_batch:
                continue
            with simulated.step():
                ctx.batch_indices = batch
                if feed is None:
                    ctx.batch_device_indices = None
                    x, y = data.x[kept[start: start + cfg.batch_size]], data.y[kept[start: start + cfg.batch_size]]
                else:
                    ctx.batch_device_indices = kept[start: start + cfg.batch_size]
                    x, y = feed.train_batch(ctx.batch_device_indices)
                if channels_last and x.dim() == 4:
                    x = x.contiguous(memory_format=torch.channels_last)
                with autocast(device, precision):
                    loss = local_objective(method, terms, model, x, y, ctx, state)
                _backward_and_step(loss, model, method, ctx, state, optimizer, owned, scaler)
                loss_sum += loss.detach().float()
            steps += 1
    if steps and not torch.isfinite(loss_sum):
        raise FloatingPointError(
            f"client {ctx.client_id} diverged in round {ctx.round} (loss is {float(loss_sum)}); "
            "lower train.lr or the method's coefficients"
        )
    return (float(loss_sum) / steps if steps else float("nan")), steps
