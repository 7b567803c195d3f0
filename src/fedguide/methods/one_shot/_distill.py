"""Training the server's model on data of its own: FedCADO's aggregation (Eq. 6) and FedDF's distillation.

FedCADO Eq. 6: L_agg(x̂, y) = CE(F_g(x̂), y) + λ·D_KL(F_g(x̂) ‖ Σ_h w_h F_h(x̂)), with
- ``ft`` (fine-tuning): λ = 0;
- ``md`` (multi-teacher distillation): λ = 1, w_h = 1/K: the target is the mean of all K client
  teachers' softmax outputs;
- ``sd`` (specific-teacher distillation): λ = 1, w_k = 1 for the client k the image was generated
  for, 0 for the others.

Decisions where the paper is silent or ambiguous:
- KL direction: the paper writes D_KL(F_g ‖ teachers), the argument order of torch's
  ``kl_div(student_log_probs, teacher_probs)``, which computes KL(teacher ‖ student), the usual
  distillation loss (Hinton et al.). That is the default (``kl_direction: teacher_student``);
  ``student_teacher`` is the literal reading, KL(student ‖ teacher).
- Temperature T (default 1, the paper names none): teacher and student logits are divided by T and the
  KL term is multiplied by T², so the gradient scale does not depend on T.
- The teachers' targets are computed once per image (teachers frozen in eval mode, no augmentation),
  not per epoch: the same numbers, once.
- Batches: a fresh permutation per epoch from a seeded generator; BatchNorm models skip a trailing
  batch of one sample (as the engine's local loop does).
"""
from __future__ import annotations

import math
from typing import Callable, Literal, Optional, Sequence, Union

import torch
import torch.nn.functional as F

from fedguide.core.training import has_batchnorm
from fedguide.registry import ConfigError

Aggregation = Literal["ft", "md", "sd"]
KLDirection = Literal["teacher_student", "student_teacher"]


def distillation_loss(student_logits: torch.Tensor, target_probs: torch.Tensor, temperature: float = 1.0,
                      direction: KLDirection = "teacher_student") -> torch.Tensor:
    """Batch mean of KL(target ‖ student) (or KL(student ‖ target)) at temperature T, times T²."""
    log_student = F.log_softmax(student_logits / temperature, dim=1)
    log_target = target_probs.clamp_min(1e-12).log()
    if direction == "teacher_student":
        kl = (target_probs * (log_target - log_student)).sum(1)
    elif direction == "student_teacher":
        kl = (log_student.exp() * (log_student - log_target)).sum(1)
    else:
        raise ConfigError(f"kl_direction '{direction}' is unknown; use teacher_student or student_teacher")
    return kl.mean() * temperature ** 2


def aggregation_loss(student_logits: torch.Tensor, labels: torch.Tensor, target_probs: Optional[torch.Tensor],
                     weight: float = 1.0, temperature: float = 1.0,
                     direction: KLDirection = "teacher_student") -> torch.Tensor:
    """FedCADO Eq. 6: CE(F_g(x̂), y) + λ·KL term; ``target_probs`` None (or λ = 0) is fine-tuning."""
    loss = F.cross_entropy(student_logits, labels)
    if target_probs is not None and weight != 0:
        loss = loss + weight * distillation_loss(student_logits, target_probs, temperature, direction)
    return loss


def teacher_targets(teacher_logits: torch.Tensor, mode: Aggregation, image_teacher: Optional[torch.Tensor] = None,
                    temperature: float = 1.0) -> Optional[torch.Tensor]:
    """The KL targets of Eq. 6 from the teachers' logits [K, N, C]: None for ``ft``; for ``md`` the mean
    over teachers of softmax(logits / T); for ``sd`` softmax(logits / T) of teacher ``image_teacher[i]``
    (an index into the first axis) for image i."""
    if mode == "ft":
        return None
    probs = F.softmax(teacher_logits / temperature, dim=-1)
    if mode == "md":
        return probs.mean(0)
    if mode == "sd":
        if image_teacher is None:
            raise ValueError("specific-teacher targets need each image's teacher index")
        return probs[image_teacher, torch.arange(probs.shape[1])]
    raise ConfigError(f"aggregation '{mode}' is unknown; use ft, md or sd")


def model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def predict_logits(model: torch.nn.Module, x: torch.Tensor, batch_size: int = 512) -> torch.Tensor:
    """The model's logits of ``x`` (held anywhere), on the model's device."""
    model.eval()
    device = model_device(model)
    return torch.cat([model(x[i: i + batch_size].to(device, non_blocking=True)) for i in range(0, len(x), batch_size)])


def fit(model: torch.nn.Module, n: int, batch_loss: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor],
        optimizer: torch.optim.Optimizer, batch_size: int, generator: torch.Generator,
        epochs: Optional[int] = None, steps: Optional[int] = None) -> float:
    """Minimise ``batch_loss(model, batch_indices)`` over ``n`` items for ``epochs`` epochs or exactly
    ``steps`` steps (one of the two); returns the mean loss."""
    if (epochs is None) == (steps is None):
        raise ValueError("give epochs or steps")

    min_batch = 2 if has_batchnorm(model) else 1
    if n < min_batch:
        raise ConfigError(f"the server's training set has {n} item(s); it needs at least {min_batch}")
    model.train()
    # The loss is summed where it is computed: reading it each step would make the host wait for the device.
    # (float64: the sum a Python float would give)
    total, taken, epoch = torch.zeros((), dtype=torch.float64, device=model_device(model)), 0, 0
    while (epoch < epochs) if epochs is not None else (taken < steps):
        order = torch.randperm(n, generator=generator)
        for start in range(0, n, batch_size):
            batch = order[start: start + batch_size]
            if batch.numel() < min_batch or (steps is not None and taken >= steps):
                continue
            loss = batch_loss(model, batch)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            total += loss.detach().double()
            taken += 1
        epoch += 1
    mean = float(total) / max(taken, 1)
    if taken and not math.isfinite(mean):
        raise FloatingPointError("server-side training diverged; lower its learning rate")
    return mean


def sgd(model: torch.nn.Module, lr: float, momentum: float, weight_decay: float) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)


def train_on_labeled(model: torch.nn.Module, x: Union[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]],
                     y: torch.Tensor, targets: Optional[torch.Tensor], epochs: int, batch_size: int,
                     optimizer: torch.optim.Optimizer, generator: torch.Generator, weight: float = 1.0,
                     temperature: float = 1.0, direction: KLDirection = "teacher_student") -> float:
    """FedCADO's aggregation: Eq. 6 on (x, y[, teacher targets]) for ``epochs`` epochs. ``x`` is the inputs,
    or a function from batch indices to the batch's inputs (a set read from disk batch by batch)."""
    rows = x if callable(x) else (lambda idx: x[idx])
    device = model_device(model)

    def batch_loss(m: torch.nn.Module, idx: torch.Tensor) -> torch.Tensor:
        # The set stays where it is kept (a synthetic set may not fit the device); each batch moves once.
        return aggregation_loss(m(rows(idx).to(device, non_blocking=True)), y[idx].to(device, non_blocking=True),
                                None if targets is None else targets[idx].to(device, non_blocking=True), weight,
                                temperature, direction)

    return fit(model, len(y), batch_loss, optimizer, batch_size, generator, epochs=epochs)


def mean_logit_targets(teacher_logits: Sequence[torch.Tensor], temperature: float = 1.0) -> torch.Tensor:
    """FedDF's ensemble target: softmax of the teachers' averaged logits (AVGLOGITS), at temperature T."""
    return F.softmax(torch.stack(list(teacher_logits)).mean(0) / temperature, dim=-1)
