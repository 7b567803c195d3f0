"""Stage 1, the mini CLIP: a projection of frozen EfficientNet-Lite0 features into MiniLM's sentence
space, trained with the CLIP loss against the class prompts' embeddings.

With one prompt per class the text side of a batch is the prompt set, so the loss is cross-entropy over
cosine logits / τ with a learned temperature (CLIP's image-to-text direction; the text tower is frozen).
The backbone is frozen, so its features are computed once, for the pool and its augmented views.

``--reuse-clip`` takes a finished folder's projection instead; it is refused before anything is written unless
that folder's mini-CLIP was trained on this run's data with this run's CLIP settings.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from fedguide.guidance.embedded.augment import random_views
from fedguide.guidance.embedded.backbones import ImageBackbone
from fedguide.guidance.embedded.clip import Projection, read_projection
from fedguide.guidance.embedded.pretrain.batches import epoch_batches
from fedguide.guidance.embedded.pretrain.card import copy_training_rows
from fedguide.guidance.embedded.pretrain.data import Pool
from fedguide.guidance.embedded.pretrain.partial import Log
from fedguide.guidance.embedded.pretrain.settings import PretrainSettings
from fedguide.guidance.progress import progress


def training_views(pool: Pool, s: PretrainSettings) -> tuple[torch.Tensor, torch.Tensor]:
    """(images, labels): the pool's originals first (their embeddings become the UNet's image tokens),
    then ``clip_augmented_views`` random views of each dataset's images."""
    views = [(pool.images, pool.labels)]
    gen = torch.Generator().manual_seed(s.seed + 7)
    for position, count in enumerate(s.clip_augmented_views):
        members = torch.nonzero(pool.sources == position).flatten()
        views += [(random_views(pool.images[members], gen), pool.labels[members]) for _ in range(count)]
    return torch.cat([v[0] for v in views]), torch.cat([v[1] for v in views])


def backbone_features(backbone: ImageBackbone, images: torch.Tensor, quiet: bool) -> torch.Tensor:
    feats = []
    with progress(len(images), "image features", enabled=not quiet) as advance, torch.no_grad():
        for start in range(0, len(images), 256):
            feats.append(backbone(images[start:start + 256]))
            advance(len(feats[-1]))
    return torch.cat(feats)


def _fit(feats: torch.Tensor, labels: torch.Tensor, targets: torch.Tensor, s: PretrainSettings,
         log: Log) -> Projection:
    """The projection trained on (features, labels) against the normalised prompt embeddings."""
    torch.manual_seed(s.seed)
    proj = Projection(out_dim=targets.shape[1])
    log_tau = torch.nn.Parameter(torch.tensor(np.log(0.07), dtype=torch.float32))
    opt = torch.optim.AdamW([*proj.parameters(), log_tau], lr=s.clip_lr, weight_decay=1e-4)
    gen = torch.Generator().manual_seed(s.seed + 1)
    steps = s.clip_epochs * max(1, len(feats) // s.clip_batch)
    batches = epoch_batches(len(feats), min(s.clip_batch, len(feats)), gen)
    for step in range(1, steps + 1):
        idx = next(batches)
        logits = F.normalize(proj(feats[idx]), dim=-1) @ targets.T / log_tau.exp().clamp_min(0.01)
        loss = F.cross_entropy(logits, labels[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 100 == 0 or step == steps:
            log("clip", step=step, loss=round(loss.item(), 4), tau=round(log_tau.exp().item(), 4), final=step == steps)
    return proj


def train_clip(pool: Pool, text_emb: torch.Tensor, s: PretrainSettings, log: Log, quiet: bool):
    """(trained projection, L2-normalised embeddings of the pool's images)."""
    backbone = ImageBackbone(s.clip_image_size)
    images, labels = training_views(pool, s)
    feats = backbone_features(backbone, images, quiet)
    targets = F.normalize(text_emb, dim=-1)
    proj = _fit(feats, labels, targets, s, log)
    with torch.no_grad():
        emb = F.normalize(proj(feats[:len(pool.images)]), dim=-1)
        train_acc = (emb @ targets.T).argmax(1).eq(pool.labels).float().mean().item()
    log("clip", train_zero_shot=round(train_acc, 4), final=True)
    return proj.eval(), emb


def reuse_clip(source: Path, pool: Pool, s: PretrainSettings, log: Log, quiet: bool):
    """A finished folder's projection in place of train_clip (same return: the pool's embeddings computed
    through it, in the same batches as train_clip computes them), its training lines copied into this run's
    log so the card still shows how the mini-CLIP was made."""
    try:
        proj, _ = read_projection(source / "image_encoder")
    except (OSError, KeyError, RuntimeError):
        raise ValueError(f"the mini-CLIP in {source} is not the architecture this version trains; drop --reuse-clip "
                         "to train one") from None
    proj.eval()
    feats = backbone_features(ImageBackbone(s.clip_image_size), pool.images, quiet)
    with torch.no_grad():
        emb = F.normalize(proj(feats), dim=-1)
    copy_training_rows(source, "clip", log)
    log("clip", reused_from=source.name, final=True)
    return proj, emb
