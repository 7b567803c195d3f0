"""Throughput of the guidance layer: feature extraction and sampling, in images per second.

    .venv/bin/python benchmarks/guidance_throughput.py [--images 256] [--sample-images 32]

Here (CPU): a tiny random SD-layout pipeline (fedguide.guidance.tiny) — extraction = VAE encode + noise +
hooked UNet pass (decoder layers 2-4) + fused PCA features, against the bare UNet forward on the same
latents; sampling = DDIM 20 steps with CFG 3. At Stable Diffusion's real size, on a GPU, every method's guidance
workload is timed by benchmarks/guidance_real_size.py.

Ends with ``extract_img_s=<f> sample_img_s=<f>`` (the tiny pipeline on this machine).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from fedguide.config import GuidanceConfig  # noqa: E402
from fedguide.guidance.features import DiffusionFeatures, FeatureSpec  # noqa: E402
from fedguide.guidance.fused import FusedFeatures  # noqa: E402
from fedguide.guidance.model import GuidanceModel  # noqa: E402
from fedguide.guidance.samplers import SamplerConfig, sample  # noqa: E402
from fedguide.guidance.tiny import build_tiny_pipeline  # noqa: E402

sys.path.insert(0, str(REPO / "benchmarks"))
from _timing import best_seconds  # noqa: E402


def tiny(args) -> tuple[float, float]:
    with tempfile.TemporaryDirectory() as tmp:
        model = GuidanceModel.from_config(GuidanceConfig(model=str(build_tiny_pipeline(Path(tmp) / "sd")), device="cpu"))
    layers = ("up.1", "up.2", "up.3")
    images = torch.rand(args.images, 3, 32, 32, generator=torch.Generator().manual_seed(0)) * 2 - 1
    prompts = ["a photo of a cat"] * args.images
    feats = DiffusionFeatures(model, FeatureSpec(layers, t=150), FusedFeatures(layers, d=64, samples_per_image=16))
    fit = min(64, args.images)  # the PCA basis is fitted on the first images
    feats.fit(images[:fit], prompts[:fit], np.arange(fit), batch_size=fit)
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

    t_extract, t_bare = best_seconds(extract), best_seconds(bare)
    extract_s, bare_s = args.images / t_extract, args.images / t_bare
    config = SamplerConfig(steps=20, guidance_scale=3.0, batch_size=args.sample_images, progress=False)
    t_sample = best_seconds(lambda: sample(model, ["a photo of a cat"] * args.sample_images, config), repeat=1)
    sample_s = args.sample_images / t_sample
    print(f"tiny pipeline, CPU ({torch.get_num_threads()} threads), batch {b}:")
    print(f"  extraction (VAE + noise + hooked UNet + fused PCA): {extract_s:8.1f} img/s")
    print(f"  bare UNet forward on latents:                     {bare_s:8.1f} img/s   ratio {bare_s / extract_s:.2f}x")
    print(f"  sampling, DDIM 20 steps, CFG 3:                    {sample_s:8.2f} img/s")
    return extract_s, sample_s


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--images", type=int, default=256)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--sample-images", type=int, default=32)
    args = ap.parse_args()
    extract_s, sample_s = tiny(args)
    print(f"extract_img_s={extract_s:.2f} sample_img_s={sample_s:.2f}")


if __name__ == "__main__":
    main()
