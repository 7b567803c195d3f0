"""What a linear probe reaches on the embedded UNet's *input*, beside the quality script's probe on its features.

    .venv/bin/python benchmarks/embedded_probe_references.py [--model-folder DIR]

The same protocol as ``embedded_guidance_quality.py``'s probe (public-pool training vectors, StandardScaler,
logistic regression with C by 3-fold cross-validation on the public pool, Fashion-MNIST test set), on
- the VAE posterior means (8x8x4 = 256 values, no noise): what the UNet is given;
- the images average-pooled to 16x16 (256 values).
If these beat the fused denoising features, the UNet's decoder (at t = 150, mean-pooled per FedDifRC's
recipe) keeps less than it is given. About 2 minutes on two CPU cores.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from embedded_guidance_quality import REPO, linear_probe, load  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-folder", type=Path, default=REPO / "src" / "fedguide" / "guidance" / "embedded" / "weights")
    args = ap.parse_args()
    from diffusers import AutoencoderKL

    ds = load("fmnist")
    vae = AutoencoderKL.from_pretrained(args.model_folder / "vae").eval()

    @torch.no_grad()
    def latents(x):
        return torch.cat([vae.encode(x[i:i + 500]).latent_dist.mean for i in range(0, len(x), 500)]).flatten(1).numpy()

    def pixels(x):
        return F.avg_pool2d(x[:, :1], 2).flatten(1).numpy()

    results = {name: linear_probe(f(ds["pub_x"]), f(ds["test_x"]), ds, name)
               for name, f in (("vae_latents", latents), ("pixels_16x16", pixels))}
    print(" ".join(f"{k}={v:.4f}" for k, v in results.items()))


if __name__ == "__main__":
    main()
