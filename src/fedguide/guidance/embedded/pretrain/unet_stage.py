"""Stage 3, the UNet: diffusers ``UNet2DConditionModel`` with four levels like SD's (so "decoder layer L
of 4" exists), ε-prediction with SD-1.5's ``DDPMScheduler`` (1000 steps, scaled-linear betas).

Its context is MiniLM's token states plus one image-embedding token. Condition dropout replaces the
prompt by the empty prompt with ``p_drop_text`` and the image token by zeros with ``p_drop_image``,
independently, so the model knows p(x), p(x|text), p(x|image) and p(x|text, image) — classifier-free and
composed guidance need all four. Latents are drawn from the VAE posterior each step; the shipped weights
are the EMA of the training weights. A checkpoint every ``checkpoint_every`` steps holds every piece of
state, the noise generator's included, so a resumed run repeats an uninterrupted run's draws.

With ``repa_weight`` > 0 the loss gains the representation-alignment term of repa.py; its projection
heads are trained here and dropped with the stage (the UNet returned is an ordinary one).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

from fedguide.guidance.embedded.pretrain.batches import MixedStepBatches, StepBatches
from fedguide.guidance.embedded.pretrain.data import Pool
from fedguide.guidance.embedded.pretrain.partial import Log, load_stage, save_atomic
from fedguide.guidance.embedded.pretrain.repa import AlignHeads, Alignment, alignment_targets, build_heads
from fedguide.guidance.embedded.pretrain.settings import PretrainSettings, stage_key
from fedguide.guidance.hooks import capture
from fedguide.guidance.progress import progress
from fedguide.guidance.timesteps import SD15_SCHEDULE

WARMUP_STEPS = 200


def build_unet(channels: tuple[int, ...], context_dim: int):
    from diffusers import UNet2DConditionModel

    levels = len(channels)
    return UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=channels,
        norm_num_groups=16, cross_attention_dim=context_dim, attention_head_dim=8,
        down_block_types=("CrossAttnDownBlock2D",) * (levels - 1) + ("DownBlock2D",),
        up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * (levels - 1))


def noise_scheduler():
    from diffusers import DDPMScheduler

    return DDPMScheduler(**SD15_SCHEDULE, clip_sample=False, prediction_type="epsilon")


@dataclass
class Inputs:
    """What every step draws from: the pool's posterior latents (already scaled) and its conditioning."""
    labels: torch.Tensor  # [N] prompt index per pool image
    lat_mean: torch.Tensor
    lat_std: torch.Tensor
    tokens: torch.Tensor  # [P, L, H] per prompt
    empty_tokens: torch.Tensor  # [1, L, H]
    image_tokens: torch.Tensor  # [N, H] per pool image, at the text tokens' scale


@dataclass
class Training:
    """The stage's mutable state: everything a checkpoint holds besides the step and the running loss."""
    unet: torch.nn.Module
    ema: object  # diffusers EMAModel
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LambdaLR
    gen: torch.Generator
    heads: Optional[AlignHeads] = None  # REPA's projection heads (repa_weight > 0), never written out

    def params(self) -> list[torch.nn.Parameter]:
        return [*self.unet.parameters(), *(self.heads.parameters() if self.heads is not None else ())]

    def state(self) -> dict:
        state = {"unet": self.unet.state_dict(), "ema": self.ema.state_dict(), "opt": self.opt.state_dict(),
                 "sched": self.sched.state_dict(), "gen": self.gen.get_state()}
        return state if self.heads is None else {**state, "heads": self.heads.state_dict()}

    def load(self, saved: dict) -> None:
        self.unet.load_state_dict(saved["unet"])
        self.ema.load_state_dict(saved["ema"])
        self.opt.load_state_dict(saved["opt"])
        self.sched.load_state_dict(saved["sched"])
        self.gen.set_state(saved["gen"])
        if self.heads is not None:
            self.heads.load_state_dict(saved["heads"])

    def step(self, loss: torch.Tensor) -> None:
        self.opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params(), 1.0)
        self.opt.step()
        self.sched.step()
        self.ema.step(self.unet.parameters())


def _start(s: PretrainSettings, context_dim: int) -> Training:
    """A fresh UNet with its EMA, optimiser, warm-up + cosine schedule and noise generator (seeded here, so
    the UNet's initial weights do not depend on what ran before), and REPA's heads when it is on."""
    from diffusers.training_utils import EMAModel

    torch.manual_seed(s.seed + 4)
    unet = build_unet(tuple(s.unet_channels), context_dim)
    ema = EMAModel(unet.parameters(), decay=s.ema_decay)
    heads = build_heads(s, context_dim) if s.repa_weight > 0 else None
    opt = torch.optim.AdamW([*unet.parameters(), *(heads.parameters() if heads is not None else ())],
                            lr=s.unet_lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: min(1.0, (i + 1) / WARMUP_STEPS)
        * 0.5 * (1 + np.cos(np.pi * min(i, s.unet_steps) / s.unet_steps)))
    return Training(unet, ema, opt, sched, torch.Generator().manual_seed(s.seed + 5), heads)


def _loss(unet, ddpm, inputs: Inputs, idx: torch.Tensor, gen: torch.Generator, s: PretrainSettings,
          align: Optional[Alignment] = None) -> dict[str, torch.Tensor]:
    """The ε-prediction loss of one batch ("loss") and, with ``align``, its REPA term ("align"); the draws
    from ``gen`` come in a fixed order (a resumed run repeats them)."""
    b = len(idx)
    x0 = inputs.lat_mean[idx] + inputs.lat_std[idx] * torch.randn(inputs.lat_mean[idx].shape, generator=gen)
    noise = torch.randn(x0.shape, generator=gen)
    t = torch.randint(0, ddpm.config.num_train_timesteps, (b,), generator=gen)
    xt = ddpm.add_noise(x0, noise, t)
    text = inputs.tokens[inputs.labels[idx]]
    drop_text = torch.rand(b, generator=gen) < s.p_drop_text
    text = torch.where(drop_text[:, None, None], inputs.empty_tokens.expand(b, -1, -1), text)
    image = inputs.image_tokens[idx] * (torch.rand(b, generator=gen) >= s.p_drop_image).float()[:, None]
    context = torch.cat([text, image[:, None]], dim=1)
    if align is None:
        return {"loss": F.mse_loss(unet(xt, t, encoder_hidden_states=context).sample, noise)}
    with capture(unet, align.layers, stop_early=False) as hidden:
        eps = unet(xt, t, encoder_hidden_states=context).sample
    return {"loss": F.mse_loss(eps, noise), "align": align.loss(hidden, idx)}


def _batches(pool: Pool, s: PretrainSettings):
    return (StepBatches(len(pool.images), s.unet_batch, s.seed + 6) if s.unet_dataset_share is None
            else MixedStepBatches(pool.sources, tuple(s.unet_dataset_share), s.unet_batch, s.seed + 6))


def _resume(training: Training, checkpoint: Optional[Path], key: dict, log: Log) -> tuple[int, Optional[dict]]:
    """(step, running losses) of the last checkpoint made with ``key``, loaded into ``training``; else (0, None)."""
    saved = load_stage(checkpoint, key) if checkpoint is not None else None
    if saved is None:
        return 0, None
    training.load(saved)  # continue a killed run exactly where its last checkpoint left it
    log("unet", resumed_at=saved["step"])
    return saved["step"], saved["running"]


def _smoothed(running: Optional[dict], terms: dict[str, torch.Tensor]) -> dict[str, float]:
    values = {k: v.item() for k, v in terms.items()}
    return values if running is None else {k: 0.98 * running[k] + 0.02 * v for k, v in values.items()}


def targets_file(checkpoint: Optional[Path]) -> Optional[Path]:
    """The alignment targets' stage file, beside the UNet checkpoint in the partial folder."""
    return None if checkpoint is None else checkpoint.with_name("repa_targets.safetensors")


def train_unet(pool: Pool, lat_mean, lat_std, tokens, empty_tokens, image_tokens, s: PretrainSettings, log: Log,
               quiet: bool, checkpoint: Optional[Path] = None, checkpoint_every: int = 250):
    training = _start(s, tokens.shape[-1])
    ddpm, batch_at = noise_scheduler(), _batches(pool, s)
    inputs = Inputs(pool.labels, lat_mean, lat_std, tokens, empty_tokens, image_tokens)
    align = (None if training.heads is None else
             Alignment(training.heads, alignment_targets(pool.images, image_tokens, s, quiet, targets_file(checkpoint)),
                       s.repa_layers))
    # The UNet is trained on the CLIP stage's image tokens and the VAE's latents: a checkpoint made
    # on other ones (or with other alignment settings) must not be continued.
    key = stage_key(s, "unet", "ema", "p_drop", "clip", "vae", "repa")
    start, running = _resume(training, checkpoint, key, log)
    with progress(s.unet_steps - start, "UNet", enabled=not quiet, unit="step") as advance:
        for step in range(start + 1, s.unet_steps + 1):
            terms = _loss(training.unet, ddpm, inputs, batch_at(step - 1), training.gen, s, align)
            training.step(terms["loss"] if align is None else terms["loss"] + s.repa_weight * terms["align"])
            running = _smoothed(running, terms)
            advance(1)
            if step % 100 == 0 or step == s.unet_steps:
                log("unet", step=step, **{k: round(v, 5) for k, v in running.items()},
                    lr=round(training.sched.get_last_lr()[0], 7), final=step == s.unet_steps)
            if checkpoint is not None and step % checkpoint_every == 0 and step < s.unet_steps:
                save_atomic({"key": key, "step": step, "running": running, **training.state()}, checkpoint)
    training.ema.copy_to(training.unet.parameters())
    return training.unet.eval()
