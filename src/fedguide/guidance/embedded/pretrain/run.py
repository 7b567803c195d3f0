"""``pretrain``: the stages in order, each reused from the ``.partial`` folder when a killed run with the
same settings finished it, then the folder written beside ``out`` and renamed into place; and the CLI.

The stages (``train_clip``, ``train_vae``) and ``write_card`` are called through this module's names, so
a test can replace them here.
"""
from __future__ import annotations

import os
import shutil
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Optional

import torch

from fedguide.guidance.embedded.clip import Projection
from fedguide.guidance.embedded.pretrain.card import check_reusable, write_card
from fedguide.guidance.embedded.pretrain.clip_stage import reuse_clip, train_clip
from fedguide.guidance.embedded.pretrain.data import Pool, encode_prompts, load_pool
from fedguide.guidance.embedded.pretrain.layout import write_layout
from fedguide.guidance.embedded.pretrain.partial import Log, load_stage, save_atomic, stage_file
from fedguide.guidance.embedded.pretrain.settings import PretrainSettings, stage_key
from fedguide.guidance.embedded.pretrain.unet_stage import train_unet
from fedguide.guidance.embedded.pretrain.vae_stage import build_vae, reuse_vae, train_vae


def _clip(pool: Pool, prompt_emb: torch.Tensor, settings: PretrainSettings, log: Log, quiet: bool, partial: Path,
          clip_source: Optional[Path]):
    """(projection, image embeddings): trained (or taken from ``clip_source``), or as a killed run with the same
    settings left them."""
    key = stage_key(settings, "clip")
    done = load_stage(stage_file(partial, "clip"), key)
    if done is None:
        proj, image_emb = (train_clip(pool, prompt_emb, settings, log, quiet) if clip_source is None
                           else reuse_clip(clip_source, pool, settings, log, quiet))
        save_atomic({"key": key, "proj": proj.state_dict(), "config": proj.config, "image_emb": image_emb},
                    stage_file(partial, "clip"))
        return proj, image_emb
    proj = Projection(**done["config"])
    proj.load_state_dict(done["proj"])
    log("clip", reused=True, final=True)
    return proj, done["image_emb"]


def _vae(pool: Pool, settings: PretrainSettings, log: Log, quiet: bool, partial: Path, vae_source: Optional[Path]):
    """(VAE, latent means, latent stds): trained (or taken from ``vae_source``), or as a killed run left them."""
    key = stage_key(settings, "vae")
    done = load_stage(stage_file(partial, "vae"), key)
    if done is None:
        vae, lat_mean, lat_std = (train_vae(pool, settings, log, quiet) if vae_source is None
                                  else reuse_vae(vae_source, pool, log))
        save_atomic({"key": key, "vae": vae.state_dict(), "scaling_factor": float(vae.config.scaling_factor),
                     "lat_mean": lat_mean, "lat_std": lat_std}, stage_file(partial, "vae"))
        return vae, lat_mean, lat_std
    vae = build_vae()
    vae.register_to_config(scaling_factor=done["scaling_factor"])
    vae.load_state_dict(done["vae"])
    vae.eval()
    log("vae", reused=True, final=True)
    return vae, done["lat_mean"], done["lat_std"]


def _train_and_write(out: Path, tmp: Path, partial: Path, settings: PretrainSettings, quiet: bool, command: str,
                     vae_source: Optional[Path], clip_source: Optional[Path]) -> None:
    log = Log(partial / "train_log.jsonl", quiet)
    pool = load_pool(settings)
    log("data", images=len(pool.images), prompts=len(pool.prompts), final=True)
    text = encode_prompts(pool.prompts, settings.max_length)
    proj, image_emb = _clip(pool, text.pooled, settings, log, quiet, partial, clip_source)
    # The image token has the text tokens' mean norm, so neither kind of token dominates attention.
    token_scale = float(text.tokens[text.mask.bool()].norm(dim=-1).mean())
    vae, lat_mean, lat_std = _vae(pool, settings, log, quiet, partial, vae_source)
    unet = train_unet(pool, lat_mean, lat_std, text.tokens, text.empty, image_emb * token_scale, settings, log, quiet,
                      checkpoint=stage_file(partial, "unet"), checkpoint_every=settings.checkpoint_every)
    write_layout(tmp, unet, vae, text.tokenizer, proj, settings.clip_image_size, token_scale, pool.prompts)
    shutil.copy2(partial / "train_log.jsonl", tmp / "train_log.jsonl")
    write_card(tmp, command or f"fedguide pretrain-guidance --out {out.name} --seed {settings.seed}",
               asdict(settings), pool.slices, log.rows)


def _replace(out: Path, tmp: Path) -> None:
    """``tmp`` renamed to ``out``; an old ``out`` is moved aside first and removed only once the new one is there."""
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old)
    else:
        tmp.rename(out)


def pretrain(out: Path, settings: PretrainSettings, quiet: bool = False, command: str = "",
             threads: Optional[int] = None, vae_source: Optional[Path] = None, clip_source: Optional[Path] = None
             ) -> Path:
    """Trains every stage and writes the SD-layout folder ``out`` (atomically replacing an old one).

    ``vae_source`` / ``clip_source``: a folder this function wrote earlier whose VAE / mini-CLIP is taken
    instead of training one (that stage's settings and data must be this run's; checked before anything is
    written)."""
    if threads:
        torch.set_num_threads(threads)
    out = Path(out).resolve()
    if vae_source is not None:
        vae_source = Path(vae_source).resolve()
        check_reusable(vae_source, settings, "vae")
    if clip_source is not None:
        clip_source = Path(clip_source).resolve()
        check_reusable(clip_source, settings, "clip")
    # Finished stages and UNet checkpoints live here until the end, so a killed run resumes where it
    # stopped (stages whose settings changed are retrained).
    partial = out.parent / f".{out.name}.partial"
    partial.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        _train_and_write(out, tmp, partial, settings, quiet, command, vae_source, clip_source)
        _replace(out, tmp)
        shutil.rmtree(partial)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # finished stages stay in the partial folder
        raise
    return out


def run_from_cli(args) -> int:
    names = ("seed", "unet_steps", "vae_steps", "clip_epochs", "clip_image_size", "repa_weight", "repa_layers",
             "repa_target", "repa_head", "unet_channels")
    fields = {k: getattr(args, k) for k in names if getattr(args, k, None) is not None}
    settings = PretrainSettings(**fields)
    command = "fedguide pretrain-guidance " + " ".join(sys.argv[2:]) if len(sys.argv) > 2 else ""
    path = pretrain(args.out, settings, quiet=args.quiet, command=command, threads=args.threads,
                    vae_source=args.reuse_vae, clip_source=args.reuse_clip)
    print(f"embedded guidance models written to {path}")
    return 0
