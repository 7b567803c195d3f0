"""Guided text-to-image sampling with a frozen GuidanceModel: CFG, composed guidance, classifier guidance.

``sample`` turns one prompt per image into images, with the guidance the one-shot methods need, all
expressed on the noise prediction ε and stepped by a diffusers scheduler (DDIM or DDPM, built with
``.from_config(model.scheduler_config)``; no stepping rule is written here):

- Classifier-free guidance: ε_cfg = ε(∅) + s·(ε(C) − ε(∅)), C the prompt's token context, ∅ the empty
  prompt's, s = ``guidance_scale``; s = 1 computes ε(C) alone.
- Composed guidance (FedDISC Eq. 7): ε̂ = ε_cfg + Σ_j w_j·(ε(c_j, C) − ε(C)), where the extra condition
  c_j is an unCLIP image condition (class labels from ``model.image_condition``, FedDISC's noised
  centroid z̄ of Eq. 5 or domain feature ḡ) or a replacement cross-attention context. With s = 1 this is
  Eq. 7 literally (ε_cfg = ε(C)); FedDISC's w_f = w_g = 2.
- Classifier guidance (FedCADO Eq. 3-5): ŝ_0 = (s_t − √(1−ᾱ_t)·ε_θ(s_t,t|y)) / √ᾱ_t (Eq. 3), the
  caller's loss L (Eq. 4: its CE + λ·L_BN) on decode(ŝ_0), and
  ε̂ = ε + loss_scale·√(1−ᾱ_t)·∇_{s_t} L (Eq. 5, sign corrected), then the scheduler's step (Eq. 2).
  Eq. 5 as printed has "−": it puts the loss L where Eq. 1 (Dhariwal & Nichol) has log p(y|s_t), whose
  gradient is −∇L, so taken literally it would climb the loss (it does, measurably). A positive
  ``loss_scale`` here lowers L; the paper's strength is ``loss_scale: 1``.
- Initial noise editing (FedCADO Sec. 3.3): before denoising, M = ``edit_steps`` updates
  s_T ← s_T − η·∇_{s_T} L(decode(ŝ_0(s_T))) at timestep ``edit_t``; the mean loss of each update (the
  loss it starts from) is recorded in ``SampleResult.edit_losses``.

Decisions where the papers are silent:

- Noise per image: image i draws its initial noise, and any scheduler noise (DDPM, DDIM with eta > 0),
  from its own CPU generator seeded with ``seed * 1_000_003 + i`` (CPU so a seed means the same noise on
  every device). An image therefore depends on (seed, i) and its prompt only, not on the batch size or
  on the other prompts (up to the UNet's own batch-size numerics). Latents start as that noise times
  ``scheduler.init_noise_sigma``; latents a caller passes are used as they are (already the initial
  state), the per-image generators still drive the scheduler noise.
- Batching: ε(C), ε(∅) and every extra condition with a nonzero weight run as one UNet call (the
  passes concatenated along the batch; passes whose contexts differ in length run as separate calls).
  A condition of weight 0 adds no pass, so all-zero weights reproduce plain CFG bit for bit.
- Gradients: everything runs under ``torch.no_grad`` except the guidance gradient, which enables grad
  for one thing only, a detached copy of the latents. The gradient flows from the loss through the
  decoder, Eq. 3 and the conditional prediction ε(C) (the paper's ε_θ(s_t,t|y), with the base class
  labels) into s_t; the unconditional and extra-condition passes stay outside the graph. With a loss,
  ε(C) therefore runs as its own grad-enabled call and the rest as one no-grad call: the same forward
  work as without a loss, and a backward pass through B samples instead of the whole batch. Gradients
  are taken with ``torch.autograd.grad`` w.r.t. the latents alone: the frozen weights (and the caller's
  classifier) never gain a ``.grad``. The loss is summed over the batch, so each image's gradient is its
  own loss's (batch statistics such as FedCADO's L_BN are the loss function's business; it receives the
  images' indices in ``prompts``, a CPU long tensor). Decoded images are handed to it as float32.
- unCLIP models need class labels on every pass; when ``base_class_labels`` is not given they are
  ``model.image_condition(zeros)`` (a zero image embedding at noise level 0), used for ε(C), ε(∅) and
  for conditions given as a context only. Non-unCLIP models take no class labels at all.
- Noise predictions are used as ε: a UNet trained for ``v_prediction`` (e.g. SD-2.1 at 768 px) or
  ``sample`` has its output converted to ε with the training schedule before any guidance
  arithmetic, and the stepping scheduler is told ``prediction_type="epsilon"``. CFG and Eq. 7 are affine
  combinations (weights summing to 1), so they are the same in either parametrisation; Eq. 3 and 5 are
  stated for ε.
- ``clip_sample`` defaults to False: a PNDM scheduler config need not name it, and DDIM/DDPM then clip
  x̂_0 to [-1, 1], which is meant for pixels, not latents. An explicit value in the config wins.
- ``edit_t`` defaults to the scheduler's first sampling timestep (the paper's "time step T").
- Not reproduced from FedCADO's released code: it moves s_t itself by −∇L and steps with the unguided
  CFG ε, and forms ŝ_0 from the CFG ε with the gradient through both passes; here Eq. 3 and 5 are
  followed (ŝ_0 from ε(C), the gradient enters through ε̂).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Optional, Sequence

import torch

from fedguide.guidance.progress import progress
from fedguide.registry import ConfigError

NOISE_SEED_STRIDE = 1_000_003
SCHEDULERS = ("ddim", "ddpm")


@dataclass
class Condition:
    """One extra condition of composed guidance (FedDISC Eq. 7); tensors hold one row per image."""

    weight: float
    class_labels: Optional[torch.Tensor] = None  # unCLIP image condition [N, D2] from model.image_condition
    context: Optional[torch.Tensor] = None  # or a replacement cross-attention context [N, L, H]


# (x̂_0 images in [-1, 1] [B, 3, H, W], indices of the images in ``prompts``) -> per-image loss [B]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class SamplerConfig:
    scheduler: Literal["ddim", "ddpm"] = "ddim"
    steps: int = 50
    guidance_scale: float = 3.0  # classifier-free guidance scale (1 = no CFG, no unconditional pass)
    eta: float = 0.0  # DDIM eta
    loss_scale: float = 1.0  # multiplies the classifier-guidance gradient
    edit_steps: int = 0  # FedCADO initial-noise editing M (paper 10)
    edit_lr: float = 0.1  # its η
    edit_t: Optional[int] = None  # timestep at which s_T is judged (default: the first sampling timestep)
    batch_size: int = 16
    seed: int = 0
    progress: bool = True
    # Position of prompts[0] in a longer sequence sampled in parts: image i of this call draws the noise of
    # image first_index + i, so a sequence sampled in chunks gets the images of one call over all of it.
    first_index: int = 0


@dataclass
class SampleResult:
    images: Optional[torch.Tensor]  # [N, 3, H, W] in [-1, 1], float32 CPU; None when decode=False
    latents: torch.Tensor  # final latents [N, C, h, w], float32 CPU
    edit_losses: list[float] = field(default_factory=list)  # mean loss over all images, per editing step
    seconds: float = 0.0
    images_per_second: float = 0.0


@dataclass
class _Pass:
    """One UNet prediction to make: a context and, for unCLIP models, class labels."""

    context: torch.Tensor
    class_labels: Optional[torch.Tensor]


# --- pure pieces ---------------------------------------------------------------------------------------
def image_generators(seed: int, indices: Sequence[int]) -> list[torch.Generator]:
    """One CPU generator per image, seeded by (seed, image index) alone."""
    return [torch.Generator().manual_seed(seed * NOISE_SEED_STRIDE + int(i)) for i in indices]


def initial_noise(generators: Sequence[torch.Generator], shape: Sequence[int]) -> torch.Tensor:
    """[len(generators), *shape] standard normal noise on the CPU, one row per generator."""
    return torch.stack([torch.randn(tuple(shape), generator=g) for g in generators])


def guided_eps(eps_cond: torch.Tensor, eps_uncond: Optional[torch.Tensor], guidance_scale: float,
               extras: Sequence[tuple[float, torch.Tensor]] = ()) -> torch.Tensor:
    """ε_cfg = ε(∅) + s·(ε(C) − ε(∅)), plus Σ_j w_j·(ε_j − ε(C)) (FedDISC Eq. 7)."""
    eps = eps_cond if eps_uncond is None else eps_uncond + guidance_scale * (eps_cond - eps_uncond)
    for weight, eps_j in extras:
        eps = eps + weight * (eps_j - eps_cond)
    return eps


def as_eps(model, output: torch.Tensor, latents: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The UNet's output as a noise prediction ε, whatever it was trained to predict."""
    kind = model.scheduler_config.get("prediction_type", "epsilon")
    output = output.float()
    if kind == "epsilon":
        return output
    a = model.alpha_bar(t).to(latents.dtype)
    if kind == "v_prediction":
        return a.sqrt() * output + (1 - a).sqrt() * latents
    if kind == "sample":
        return (latents - a.sqrt() * output) / (1 - a).sqrt()
    raise ConfigError(f"the scheduler config's prediction_type '{kind}' is unknown; "
                      "expected epsilon, v_prediction or sample")


def make_scheduler(model, config: SamplerConfig):
    """A fresh DDIM or DDPM scheduler on the model's training schedule, with ``config.steps`` set."""
    from diffusers import DDIMScheduler, DDPMScheduler

    sched_config = dict(model.scheduler_config)
    sched_config.setdefault("clip_sample", False)
    sched_config["prediction_type"] = "epsilon"  # as_eps has converted every output to ε
    cls = DDIMScheduler if config.scheduler == "ddim" else DDPMScheduler
    scheduler = cls.from_config(sched_config)
    scheduler.set_timesteps(config.steps, device=model.device)
    return scheduler


# --- validation ----------------------------------------------------------------------------------------
def _check_config(config: SamplerConfig, loss_fn: Optional[LossFn], num_train_timesteps: int) -> None:
    if config.scheduler not in SCHEDULERS:
        raise ConfigError(f"unknown sampler scheduler '{config.scheduler}'; use one of {', '.join(SCHEDULERS)}")
    if config.steps < 1:
        raise ConfigError(f"sampler steps must be at least 1, got {config.steps}")
    if config.steps > num_train_timesteps:
        raise ConfigError(f"sampler steps {config.steps} exceed the model's {num_train_timesteps} training "
                          "timesteps; use fewer steps")
    if config.batch_size < 1:
        raise ConfigError(f"sampler batch_size must be at least 1, got {config.batch_size}")
    if not math.isfinite(config.guidance_scale):
        raise ConfigError(f"guidance_scale must be a finite number, got {config.guidance_scale}")
    if config.scheduler == "ddpm" and config.eta != 0:
        raise ConfigError("eta is a DDIM setting (DDPM is stochastic by construction); set eta: 0 or "
                          "scheduler: ddim")
    if config.edit_steps < 0:
        raise ConfigError(f"edit_steps must be 0 (no initial noise editing) or more, got {config.edit_steps}")
    if config.edit_steps > 0 and loss_fn is None:
        raise ConfigError(f"edit_steps={config.edit_steps} edits the initial noise with a loss's gradient; "
                          "pass loss_fn or set edit_steps: 0")
    if config.edit_t is not None and not 0 <= config.edit_t < num_train_timesteps:
        raise ConfigError(f"edit_t must be a timestep in [0, {num_train_timesteps}), got {config.edit_t}")


def _check_rows(name: str, tensor: torch.Tensor, n: int) -> None:
    if tensor.ndim < 2 or tensor.shape[0] != n:
        raise ConfigError(f"{name} must hold one row per prompt ({n}), got shape {tuple(tensor.shape)}")


def _check_class_labels(model, name: str, labels: torch.Tensor, n: int) -> None:
    if not model.is_unclip:
        raise ConfigError(f"{name} are unCLIP image conditions, but this guidance model has no image "
                          "conditioning; use an unCLIP model (e.g. stabilityai/stable-diffusion-2-1-unclip) "
                          "or give the condition as a context")
    _check_rows(name, labels, n)
    width = model.unet.config.projection_class_embeddings_input_dim
    if labels.ndim != 2 or labels.shape[1] != width:
        raise ConfigError(f"{name} must be [N, {width}] (from model.image_condition), got {tuple(labels.shape)}")


def _check_inputs(model, prompts: Sequence[str], conditions: Sequence[Condition],
                  base_class_labels: Optional[torch.Tensor], latents: Optional[torch.Tensor]) -> None:
    if isinstance(prompts, str):
        raise ConfigError("prompts must be a sequence of strings, one per image, not a single string")
    n = len(prompts)
    if n == 0:
        raise ConfigError("sample() needs at least one prompt (one image is made per prompt)")
    if base_class_labels is not None:
        _check_class_labels(model, "base_class_labels", base_class_labels, n)
    for j, cond in enumerate(conditions):
        if cond.class_labels is None and cond.context is None:
            raise ConfigError(f"condition {j} has neither class_labels nor context; give one of them")
        if cond.class_labels is not None:
            _check_class_labels(model, f"condition {j}'s class_labels", cond.class_labels, n)
        if cond.context is not None:
            _check_rows(f"condition {j}'s context", cond.context, n)
            if cond.context.ndim != 3 or cond.context.shape[-1] != model.context_dim:
                raise ConfigError(f"condition {j}'s context must be [N, L, {model.context_dim}] (the UNet's "
                                  f"cross_attention_dim), got {tuple(cond.context.shape)}")
        if not math.isfinite(cond.weight):
            raise ConfigError(f"condition {j}'s weight must be a finite number, got {cond.weight}")
    if latents is not None:
        if latents.ndim != 4 or latents.shape[0] != n or latents.shape[1] != model.latent_channels:
            raise ConfigError(f"latents must be [{n}, {model.latent_channels}, h, w] (one per prompt), "
                              f"got shape {tuple(latents.shape)}")


# --- UNet passes and the guidance gradient -------------------------------------------------------------
def _compatible(a: _Pass, b: _Pass) -> bool:
    if a.context.shape[1:] != b.context.shape[1:]:
        return False
    if (a.class_labels is None) != (b.class_labels is None):
        return False
    return a.class_labels is None or a.class_labels.shape[1:] == b.class_labels.shape[1:]


def _run_passes(model, latents: torch.Tensor, t: torch.Tensor, passes: Sequence[_Pass]) -> list[torch.Tensor]:
    """ε for every pass, consecutive passes of matching shapes batched into one UNet call."""
    groups: list[list[_Pass]] = []
    for p in passes:
        if groups and _compatible(groups[-1][0], p):
            groups[-1].append(p)
        else:
            groups.append([p])
    out: list[torch.Tensor] = []
    for group in groups:
        k = len(group)
        x = latents.repeat(k, 1, 1, 1)
        context = torch.cat([p.context for p in group])
        labels = None if group[0].class_labels is None else torch.cat([p.class_labels for p in group])
        eps = as_eps(model, model.eps(x, t, context, class_labels=labels), x, t)
        out.extend(eps.chunk(k))
    return out


# float16 backpropagation through the UNet and the VAE decoder leaves FedCADO's gradients (entries of
# ~1e-5 at SD-1.5 size) in float16's subnormal range; a scaled loss keeps them representable (as AMP's
# GradScaler does for weights), and the result is unscaled in float32.
HALF_LOSS_SCALE = 2.0 ** 16


def scaled_gradient(objective: Callable[[torch.Tensor], tuple[torch.Tensor, Any]], x: torch.Tensor,
                    dtype: torch.dtype) -> tuple[torch.Tensor, Any]:
    """(∇_x loss, aux) for ``loss, aux = objective(x)``. For a float16 model the loss is scaled before
    backpropagation; on overflow the scale is lowered and the objective re-run (no graph is kept for a
    retry: that would double the peak memory of every step for a rare event)."""
    scale = HALF_LOSS_SCALE if dtype == torch.float16 else 1.0
    while True:
        leaf = x.detach().requires_grad_(True)
        loss, aux = objective(leaf)
        if scale == 1:
            return torch.autograd.grad(loss, leaf)[0], aux
        (grad,) = torch.autograd.grad(loss * scale, leaf)
        if torch.isfinite(grad).all():
            return grad.float() / scale, aux
        scale = max(scale / 2 ** 4, 1.0)


def _loss_gradient(model, latents: torch.Tensor, t: torch.Tensor, cond: _Pass, loss_fn: LossFn,
                   idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ε(C) detached, ∇_{s_t} Σ L(decode(ŝ_0)), the per-image losses), ŝ_0 by FedCADO Eq. 3."""
    def objective(s: torch.Tensor):
        eps_cond = as_eps(model, model.eps(s, t, cond.context, class_labels=cond.class_labels), s, t)
        images = model.decode(model.predict_x0(s, t, eps_cond)).float()
        losses = loss_fn(images, idx)
        if not isinstance(losses, torch.Tensor) or losses.shape != (s.shape[0],):
            shape = tuple(losses.shape) if isinstance(losses, torch.Tensor) else type(losses).__name__
            raise ConfigError(f"loss_fn must return one loss per image, shape [{s.shape[0]}], got {shape}")
        return losses.sum(), (eps_cond, losses)

    with torch.enable_grad():
        grad, (eps_cond, losses) = scaled_gradient(objective, latents, model.dtype)
    return eps_cond.detach(), grad, losses.detach().float()


# --- one batch -----------------------------------------------------------------------------------------
@dataclass
class _Batch:
    idx: torch.Tensor  # indices of its images in ``prompts`` (CPU long)
    cond: _Pass  # ε(C)
    uncond: Optional[_Pass]  # ε(∅), None without CFG
    extras: list[tuple[float, _Pass]]  # nonzero-weight conditions
    generators: list[torch.Generator]


def _default_class_labels(model, n: int) -> Optional[torch.Tensor]:
    if not model.is_unclip:
        return None
    dim = int(model.image_normalizer.mean.shape[-1])
    return model.image_condition(torch.zeros(n, dim, device=model.device, dtype=model.dtype))


def _make_batch(model, prompts: Sequence[str], idx: list[int], config: SamplerConfig,
                conditions: Sequence[Condition], base_class_labels: Optional[torch.Tensor]) -> _Batch:
    def rows(x: torch.Tensor) -> torch.Tensor:
        return x[idx].to(model.device, model.dtype)

    labels = rows(base_class_labels) if base_class_labels is not None else _default_class_labels(model, len(idx))
    context = model.encode_text([prompts[i] for i in idx]).tokens
    cond = _Pass(context, labels)
    uncond = _Pass(model.empty_text(len(idx)).tokens, labels) if config.guidance_scale != 1 else None
    extras = []
    for c in conditions:
        if c.weight == 0:
            continue  # skipped, so all-zero weights give plain CFG exactly
        extras.append((float(c.weight), _Pass(rows(c.context) if c.context is not None else context,
                                              rows(c.class_labels) if c.class_labels is not None else labels)))
    return _Batch(torch.tensor(idx, dtype=torch.long), cond, uncond, extras,
                  image_generators(config.seed, [config.first_index + i for i in idx]))


def _edit_noise(model, latents: torch.Tensor, t: torch.Tensor, batch: _Batch, loss_fn: LossFn,
                config: SamplerConfig) -> tuple[torch.Tensor, list[float]]:
    """FedCADO initial noise editing: M gradient steps on s_T; the summed loss each step starts from."""
    loss_sums = []
    for _ in range(config.edit_steps):
        _, grad, losses = _loss_gradient(model, latents, t, batch.cond, loss_fn, batch.idx)
        loss_sums.append(losses.sum())  # kept where it is computed: read once after the steps, not at each
        latents = latents - config.edit_lr * grad
    return latents, torch.stack(loss_sums).tolist() if loss_sums else []


def _denoise_step(model, scheduler, latents: torch.Tensor, t: torch.Tensor, batch: _Batch,
                  loss_fn: Optional[LossFn], config: SamplerConfig, step_t: int) -> torch.Tensor:
    """One denoising step at ``t`` (on the model's device; ``step_t`` the same timestep as a number)."""
    x = scheduler.scale_model_input(latents, t)
    others = ([batch.uncond] if batch.uncond is not None else []) + [p for _, p in batch.extras]
    if loss_fn is None:
        eps_all = _run_passes(model, x, t, [batch.cond] + others)
        eps_cond, rest = eps_all[0], eps_all[1:]
        grad = None
    else:
        eps_cond, grad, _ = _loss_gradient(model, x, t, batch.cond, loss_fn, batch.idx)
        rest = _run_passes(model, x, t, others) if others else []
    eps_uncond = rest.pop(0) if batch.uncond is not None else None
    eps = guided_eps(eps_cond, eps_uncond, config.guidance_scale,
                     [(w, e) for (w, _), e in zip(batch.extras, rest)])
    if grad is not None:
        # FedCADO Eq. 5 with the sign that descends the loss (see the module docstring)
        eps = eps + config.loss_scale * (1 - model.alpha_bar(t)).sqrt() * grad
    kwargs = {"eta": config.eta} if config.scheduler == "ddim" else {}
    # The scheduler takes the timestep as a number (its documented type): with a device tensor, its table
    # lookups and comparisons would read the timestep on the host at every step.
    return scheduler.step(eps, step_t, latents, generator=batch.generators, **kwargs).prev_sample


# --- the entry point -----------------------------------------------------------------------------------
def sample(model, prompts: Sequence[str], config: SamplerConfig, conditions: Sequence[Condition] = (),
           base_class_labels: Optional[torch.Tensor] = None, loss_fn: Optional[LossFn] = None,
           latents: Optional[torch.Tensor] = None, decode: bool = True) -> SampleResult:
    """One image per prompt, guided as the module docstring describes; see SampleResult for the outputs."""
    _check_config(config, loss_fn, model.num_train_timesteps)
    _check_inputs(model, prompts, conditions, base_class_labels, latents)
    conditions = list(conditions)
    n = len(prompts)
    start = time.perf_counter()
    scheduler = make_scheduler(model, config)
    edit_t = scheduler.timesteps[0] if config.edit_t is None else torch.tensor(config.edit_t, device=model.device)
    shape = (model.latent_channels, model.latent_size, model.latent_size)
    images, finals = [], []
    edit_sums = [0.0] * (config.edit_steps if loss_fn is not None else 0)
    step_ts = [int(v) for v in scheduler.timesteps.tolist()]  # read once, for every batch's scheduler steps
    with torch.no_grad(), progress(n, "sampling", enabled=config.progress) as advance:
        for lo in range(0, n, config.batch_size):
            idx = list(range(lo, min(lo + config.batch_size, n)))
            batch = _make_batch(model, prompts, idx, config, conditions, base_class_labels)
            if latents is None:
                s = initial_noise(batch.generators, shape) * scheduler.init_noise_sigma
            else:
                s = latents[idx].float()
            s = s.to(model.device)
            if edit_sums:
                s, sums = _edit_noise(model, s, edit_t, batch, loss_fn, config)
                edit_sums = [a + b for a, b in zip(edit_sums, sums)]
            for t, step_t in zip(scheduler.timesteps, step_ts):
                s = _denoise_step(model, scheduler, s, t, batch, loss_fn, config, step_t)
            finals.append(s.float().cpu())
            if decode:
                images.append(model.decode(s).float().cpu())
            advance(len(idx))
    seconds = time.perf_counter() - start
    return SampleResult(images=torch.cat(images) if decode else None, latents=torch.cat(finals),
                        edit_losses=[v / n for v in edit_sums], seconds=seconds,
                        images_per_second=n / max(seconds, 1e-9))
