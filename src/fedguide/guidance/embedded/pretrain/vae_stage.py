"""Stage 2, the VAE: diffusers ``AutoencoderKL`` 32x32x3 -> 8x8x4, L2 reconstruction + ``vae_kl`` x KL,
its ``scaling_factor`` then set to 1 / std of the pool's latents (Stable Diffusion's convention).

``--reuse-vae`` takes a finished folder's VAE instead; it is refused before anything is written unless
that folder's VAE was trained on this run's data with this run's VAE settings.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from fedguide.guidance.embedded.pretrain.batches import epoch_batches
from fedguide.guidance.embedded.pretrain.card import copy_training_rows
from fedguide.guidance.embedded.pretrain.data import Pool
from fedguide.guidance.embedded.pretrain.partial import Log
from fedguide.guidance.embedded.pretrain.settings import PretrainSettings
from fedguide.guidance.progress import progress


def build_vae():
    from diffusers import AutoencoderKL

    return AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(16, 32, 64),
                         down_block_types=("DownEncoderBlock2D",) * 3, up_block_types=("UpDecoderBlock2D",) * 3,
                         layers_per_block=1, norm_num_groups=8, sample_size=32)


def _fit(vae, pool: Pool, s: PretrainSettings, log: Log, quiet: bool) -> None:
    opt = torch.optim.AdamW(vae.parameters(), lr=s.vae_lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, s.vae_steps)
    gen = torch.Generator().manual_seed(s.seed + 3)
    batches = epoch_batches(len(pool.images), s.vae_batch, gen)
    with progress(s.vae_steps, "VAE", enabled=not quiet, unit="step") as advance:
        for step in range(1, s.vae_steps + 1):
            x = pool.images[next(batches)]
            dist = vae.encode(x).latent_dist
            rec = vae.decode(dist.sample(gen)).sample
            mse = F.mse_loss(rec, x)
            kl = dist.kl().mean() / x[0].numel()
            loss = mse + s.vae_kl * kl
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            advance(1)
            if step % 100 == 0 or step == s.vae_steps:
                log("vae", step=step, mse=round(mse.item(), 5), kl=round(kl.item(), 3), final=step == s.vae_steps)


def train_vae(pool: Pool, s: PretrainSettings, log: Log, quiet: bool):
    """(trained VAE, posterior mean and std of every pool image, both scaled by its scaling_factor)."""
    torch.manual_seed(s.seed + 2)
    vae = build_vae()
    _fit(vae, pool, s, log, quiet)
    vae.eval()
    mean, std, rec = posterior(vae, pool)
    scale = float(1.0 / mean.std())
    vae.register_to_config(scaling_factor=scale)
    log("vae", scaling_factor=round(scale, 5), recon_mse=round(F.mse_loss(rec, pool.images).item(), 5), final=True)
    return vae, mean * scale, std * scale


def posterior(vae, pool: Pool):
    """The VAE posterior's mean and std of every pool image (unscaled) and the reconstructions of the means."""
    with torch.no_grad():
        dists = [vae.encode(pool.images[i:i + 256]).latent_dist for i in range(0, len(pool.images), 256)]
        mean = torch.cat([d.mean for d in dists])
        std = torch.cat([d.std for d in dists])
        rec = torch.cat([vae.decode(mean[i:i + 256]).sample for i in range(0, len(mean), 256)])
    return mean, std, rec


def reuse_vae(source: Path, pool: Pool, log: Log):
    """A finished folder's VAE in place of train_vae (same return), its training lines copied into this
    run's log so the card still shows how the VAE was made."""
    from diffusers import AutoencoderKL

    vae = build_vae()
    loaded = AutoencoderKL.from_pretrained(source / "vae")
    try:
        vae.load_state_dict(loaded.state_dict())
    except RuntimeError:
        raise ValueError(f"the VAE in {source} is not the architecture this version trains; drop --reuse-vae "
                         "to train a VAE") from None
    scale = loaded.config.scaling_factor
    vae.register_to_config(scaling_factor=scale)
    vae.eval()
    mean, std, _ = posterior(vae, pool)
    copy_training_rows(source, "vae", log)
    log("vae", reused_from=source.name, final=True)
    return vae, mean * scale, std * scale
