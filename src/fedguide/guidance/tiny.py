"""Tiny, randomly initialised Stable-Diffusion-layout pipelines, written to a folder.

They exercise every code path of the guidance layer in seconds on a CPU (tests, benchmarks, a smoke test
of a new install) and are saved in exactly the layout of ``runwayml/stable-diffusion-v1-5`` (vae/, unet/,
text_encoder/, tokenizer/, scheduler/, model_index.json) — plus image_encoder/ (a CLIP vision tower with
projection) and, for ``unclip=True``, the unCLIP extras (image_normalizer/, image_noising_scheduler/ and a
UNet with a projection class embedding), as ``stabilityai/stable-diffusion-2-1-unclip`` has them.
Random weights: nothing here is meaningful beyond shapes and arithmetic.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

# A character-level CLIP BPE vocabulary: no merges, so every word splits into letters.
_CHARS = "abcdefghijklmnopqrstuvwxyz0123456789{}-'"
TEXT_HIDDEN = 32
IMAGE_EMBED = 16


def clip_char_tokenizer(folder: Path, max_length: int):
    """A CLIPTokenizer over single characters (no merges), saved to ``folder``: no vocabulary download."""
    from transformers import CLIPTokenizer

    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for c in _CHARS:
        vocab[c] = len(vocab)
        vocab[c + "</w>"] = len(vocab)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n")
    tok = CLIPTokenizer(str(folder / "vocab.json"), str(folder / "merges.txt"), model_max_length=max_length,
                        pad_token="<|endoftext|>")
    tok.save_pretrained(str(folder))
    return tok


def build_tiny_pipeline(folder: Path | str, seed: int = 0, image_size: int = 32, unclip: bool = False,
                        image_encoder: bool = True, max_length: int = 16) -> Path:
    """Writes a tiny SD-layout pipeline to ``folder`` and returns it (32x32 images -> 4x8x8 latents)."""
    from diffusers import AutoencoderKL, DDPMScheduler, PNDMScheduler, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPVisionConfig, CLIPVisionModelWithProjection

    import diffusers
    import transformers

    transformers.utils.logging.disable_progress_bar()
    diffusers.utils.logging.disable_progress_bar()
    folder = Path(folder)
    torch.manual_seed(seed)
    tok = clip_char_tokenizer(folder / "tokenizer", max_length)
    text = CLIPTextModel(CLIPTextConfig(vocab_size=len(tok), hidden_size=TEXT_HIDDEN, intermediate_size=64,
                                        num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=max_length,
                                        eos_token_id=1, bos_token_id=0, pad_token_id=1))
    text.save_pretrained(str(folder / "text_encoder"))
    vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(16, 32, 32),
                        down_block_types=("DownEncoderBlock2D",) * 3, up_block_types=("UpDecoderBlock2D",) * 3,
                        layers_per_block=1, norm_num_groups=8, sample_size=image_size)
    vae.save_pretrained(str(folder / "vae"))
    unet_kw = {}
    if unclip:
        # unCLIP: the image embedding (noised, then concatenated with its noise-level embedding) enters
        # through a projection class embedding, as in SD-2.1-unCLIP.
        unet_kw = {"class_embed_type": "projection", "projection_class_embeddings_input_dim": 2 * IMAGE_EMBED}
    unet = UNet2DConditionModel(
        sample_size=image_size // 4, in_channels=4, out_channels=4, layers_per_block=1,
        block_out_channels=(32, 32, 64, 64), norm_num_groups=8, cross_attention_dim=TEXT_HIDDEN,
        attention_head_dim=8,
        down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"), **unet_kw)
    unet.save_pretrained(str(folder / "unet"))
    # SD-1.5 ships a PNDM config; the samplers rebuild DDIM or DDPM from it (same betas).
    sched = PNDMScheduler(num_train_timesteps=1000, beta_schedule="scaled_linear", beta_start=0.00085,
                          beta_end=0.012, set_alpha_to_one=False, skip_prk_steps=True, steps_offset=1)
    sched.save_pretrained(str(folder / "scheduler"))
    components = {"vae": ["diffusers", "AutoencoderKL"], "unet": ["diffusers", "UNet2DConditionModel"],
                  "text_encoder": ["transformers", "CLIPTextModel"], "tokenizer": ["transformers", "CLIPTokenizer"],
                  "scheduler": ["diffusers", "PNDMScheduler"]}
    if image_encoder or unclip:
        vision = CLIPVisionModelWithProjection(CLIPVisionConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=image_size,
            patch_size=8, projection_dim=IMAGE_EMBED))
        vision.save_pretrained(str(folder / "image_encoder"))
        components["image_encoder"] = ["transformers", "CLIPVisionModelWithProjection"]
    if unclip:
        from diffusers.pipelines.stable_diffusion.stable_unclip_image_normalizer import StableUnCLIPImageNormalizer

        StableUnCLIPImageNormalizer(embedding_dim=IMAGE_EMBED).save_pretrained(str(folder / "image_normalizer"))
        DDPMScheduler(num_train_timesteps=1000, beta_schedule="squaredcos_cap_v2").save_pretrained(
            str(folder / "image_noising_scheduler"))
        components["image_normalizer"] = ["stable_diffusion", "StableUnCLIPImageNormalizer"]
        components["image_noising_scheduler"] = ["diffusers", "DDPMScheduler"]
    index = {"_class_name": "StableUnCLIPImg2ImgPipeline" if unclip else "StableDiffusionPipeline",
             "_diffusers_version": "0.0.0", **components}
    (folder / "model_index.json").write_text(json.dumps(index, indent=1))
    return folder


def build_tiny_clip(folder: Path | str, seed: int = 0, image_size: int = 32, max_length: int = 16) -> Path:
    """Writes a tiny random full CLIPModel (both towers, projections, tokenizer) to ``folder``."""
    from transformers import CLIPConfig, CLIPModel

    folder = Path(folder)
    torch.manual_seed(seed)
    tok = clip_char_tokenizer(folder, max_length)
    config = CLIPConfig(
        text_config={"vocab_size": len(tok), "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                     "num_attention_heads": 2, "max_position_embeddings": max_length, "eos_token_id": 1,
                     "bos_token_id": 0, "pad_token_id": 1},
        vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                       "image_size": image_size, "patch_size": 8},
        projection_dim=IMAGE_EMBED)
    CLIPModel(config).save_pretrained(str(folder))
    return folder
