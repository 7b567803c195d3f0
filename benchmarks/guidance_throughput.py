"""Throughput of the guidance layer: feature extraction and sampling, in images per second.

    .venv/bin/python benchmarks/guidance_throughput.py [--images 256] [--sample-images 32]

Here (CPU): a tiny random SD-layout pipeline (fedguide.guidance.tiny) — extraction = VAE encode + noise +
hooked UNet pass (decoder layers 2-4) + fused PCA features, against the bare UNet forward on the same
latents; sampling = DDIM 20 steps with CFG 3. Where CUDA is available it also builds a randomly
initialised SD-1.5-sized UNet and VAE from their published configs (fp16, 64x64 latents = 512x512 images)
and compares extraction from latents (hooks + PCA) with the UNet's bare forward (target: within 2x);
the VAE encode of 512-px images is timed on its own line.

Ends with ``extract_img_s=<f> sample_img_s=<f>`` (the tiny pipeline on this machine).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from fedguide.guidance.config import GuidanceConfig  # noqa: E402
from fedguide.guidance.features import DiffusionFeatures, FeatureSpec  # noqa: E402
from fedguide.guidance.fused import FusedFeatures  # noqa: E402
from fedguide.guidance.hooks import unet_features  # noqa: E402
from fedguide.guidance.model import GuidanceModel  # noqa: E402
from fedguide.guidance.samplers import SamplerConfig, sample  # noqa: E402
from fedguide.guidance.tiny import build_tiny_pipeline  # noqa: E402


def timed(fn, repeat: int = 3) -> float:
    """Best of ``repeat`` wall times of fn() (after one warm-up call), synchronising CUDA."""
    fn()
    best = float("inf")
    for _ in range(repeat):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def tiny(args) -> tuple[float, float]:
    with tempfile.TemporaryDirectory() as tmp:
        model = GuidanceModel.from_config(GuidanceConfig(model=str(build_tiny_pipeline(Path(tmp) / "sd")), device="cpu"))
    layers = ("up.1", "up.2", "up.3")
    images = torch.rand(args.images, 3, 32, 32, generator=torch.Generator().manual_seed(0)) * 2 - 1
    prompts = ["a photo of a cat"] * args.images
    feats = DiffusionFeatures(model, FeatureSpec(layers, t=150), FusedFeatures(layers, d=64, samples_per_image=16))
    feats.fit(images[:64], prompts[:64], np.arange(64), batch_size=64)
    b = args.batch

    def extract():
        for i in range(0, args.images, b):
            feats(images[i:i + b], prompts[i:i + b], np.arange(i, i + b))

    latents = model.encode_image(images[:b]).detach()
    context = model.encode_text(tuple(prompts[:b])).tokens

    def bare():
        with torch.no_grad():
            for _ in range(0, args.images, b):
                model.eps(latents, 150, context)

    t_extract, t_bare = timed(extract), timed(bare)
    extract_s, bare_s = args.images / t_extract, args.images / t_bare
    config = SamplerConfig(steps=20, guidance_scale=3.0, batch_size=args.sample_images, progress=False)
    t_sample = timed(lambda: sample(model, ["a photo of a cat"] * args.sample_images, config), repeat=1)
    sample_s = args.sample_images / t_sample
    print(f"tiny pipeline, CPU ({torch.get_num_threads()} threads), batch {b}:")
    print(f"  extraction (VAE + noise + hooked UNet + fused PCA): {extract_s:8.1f} img/s")
    print(f"  bare UNet forward on latents:                     {bare_s:8.1f} img/s   ratio {bare_s / extract_s:.2f}x")
    print(f"  sampling, DDIM 20 steps, CFG 3:                    {sample_s:8.2f} img/s")
    return extract_s, sample_s


def sd15_gpu(batch: int) -> None:
    from diffusers import AutoencoderKL, UNet2DConditionModel

    device, dtype = torch.device("cuda"), torch.float16
    unet = UNet2DConditionModel(sample_size=64, cross_attention_dim=768, attention_head_dim=8, layers_per_block=2,
                                block_out_channels=(320, 640, 1280, 1280)).to(device, dtype).eval()
    vae = AutoencoderKL(block_out_channels=(128, 256, 512, 512), layers_per_block=2, latent_channels=4,
                        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                        sample_size=512).to(device, dtype).eval()

    class Wrapped:  # the two calls of GuidanceModel that unet_features uses
        def __init__(self):
            self.unet = unet

        def eps(self, lat, t, ctx, class_labels=None):
            return unet(lat, torch.full((lat.shape[0],), int(t), device=device), encoder_hidden_states=ctx).sample

    m = Wrapped()
    lat = torch.randn(batch, 4, 64, 64, device=device, dtype=dtype)
    ctx = torch.randn(batch, 77, 768, device=device, dtype=dtype)
    layers = ("up.1", "up.2", "up.3")
    fused = FusedFeatures(layers, d=512, samples_per_image=64)
    with torch.no_grad():
        fused.fit([unet_features(m, lat, 150, ctx, layers) for _ in range(2)])
        t_bare = timed(lambda: m.eps(lat, 150, ctx))
        t_ext = timed(lambda: fused(unet_features(m, lat, 150, ctx, layers)))
        x = torch.rand(batch, 3, 512, 512, device=device, dtype=dtype) * 2 - 1
        t_vae = timed(lambda: vae.encode(x).latent_dist.mean)
    print(f"SD-1.5-sized UNet, {torch.cuda.get_device_name()}, fp16, 64x64 latents, batch {batch}:")
    print(f"  bare UNet forward:                  {batch / t_bare:8.1f} img/s")
    print(f"  extraction from latents (hooks+PCA): {batch / t_ext:8.1f} img/s   ratio {t_ext / t_bare:.2f}x (target <= 2)")
    print(f"  VAE encode of 512-px images:         {batch / t_vae:8.1f} img/s")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--images", type=int, default=256)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--sample-images", type=int, default=32)
    ap.add_argument("--gpu-batch", type=int, default=16)
    args = ap.parse_args()
    extract_s, sample_s = tiny(args)
    if torch.cuda.is_available():
        sd15_gpu(args.gpu_batch)
    else:
        print("no CUDA device: the SD-1.5-sized comparison is skipped")
    print(f"extract_img_s={extract_s:.2f} sample_img_s={sample_s:.2f}")


if __name__ == "__main__":
    main()
