"""How much class information the quality script's probe can find at its timestep, whatever the UNet learns.

    .venv/bin/python benchmarks/embedded_probe_ceiling.py [--model-folder DIR] [--out FILE.json]

The probe of ``embedded_guidance_quality.py`` reads the UNet's features of a *noised* latent (t = 150 of
SD-1.5's schedule, ᾱ = 0.83). Every feature the UNet computes there is a function of that noisy latent, so
the class information in it bounds the probe. Two readings of that bound on Fashion-MNIST, each at
t in ``--timesteps``:
- linear: the probe's own protocol (public-pool training vectors, StandardScaler, logistic regression with C
  by 3-fold cross-validation on the public pool, the test set) on the noisy latents themselves, with the
  very noise the feature probe draws, beside the feature probe at the same t;
- supervised: a small CNN trained on the public pool's *labels* (fresh noise every batch), scored on the
  test set with that noise — a generous bound for features learnt without those labels. Its inputs: the
  VAE latents (8x8x4); and, to tell the VAE's share from the noise's, the images themselves at 16x16 and
  32x32, standardised to unit variance as the latents are by the VAE's scaling factor and noised with the
  same ᾱ_t.
About 25 minutes on two CPU cores (the 32x32 CNNs take 14 of them).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from embedded_guidance_quality import PROBE_T, REPO, linear_probe, load, probe  # noqa: E402

from fedguide.core.atomic import write_text  # noqa: E402
from fedguide.guidance.features import sample_noise  # noqa: E402

TEST_OFFSET = 10 ** 6  # the quality probe's noise index offset of test images


def classifier(channels: int, size: int) -> torch.nn.Module:
    """Four 3x3 convolutions, two poolings down to at most 4x4 on the way, global average, linear."""
    nn = torch.nn
    return nn.Sequential(
        nn.Conv2d(channels, 32, 3, padding=1), nn.SiLU(), nn.Conv2d(32, 64, 3, padding=1), nn.SiLU(), nn.MaxPool2d(2),
        nn.Conv2d(64, 128, 3, padding=1), nn.SiLU(), nn.MaxPool2d(2) if size > 8 else nn.Identity(),
        nn.Conv2d(128, 128, 3, padding=1), nn.SiLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.3),
        nn.Linear(128, 10))


def noised(x: torch.Tensor, alpha_bar: float, noise: torch.Tensor) -> torch.Tensor:
    return alpha_bar ** 0.5 * x + (1 - alpha_bar) ** 0.5 * noise


def supervised(train_x, train_y, test_x, test_y, alpha_bar: float, epochs: int, seed: int) -> float:
    """Test accuracy of a CNN trained on noised ``train_x`` (new noise each batch); the test noise is the
    quality probe's (seeded per test index)."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    net = classifier(train_x.shape[1], train_x.shape[-1])
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3, weight_decay=1e-2)
    for _ in range(epochs):
        for batch in torch.randperm(len(train_x), generator=gen).split(128):
            x = noised(train_x[batch], alpha_bar, torch.randn(train_x[batch].shape, generator=gen))
            loss = F.cross_entropy(net(x), train_y[batch])
            opt.zero_grad()
            loss.backward()
            opt.step()
    net.eval()
    test_noise = sample_noise(np.arange(len(test_x)) + TEST_OFFSET, test_x.shape[1:], seed)
    with torch.no_grad():
        return net(noised(test_x, alpha_bar, test_noise)).argmax(1).eq(test_y).float().mean().item()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-folder", type=Path, default=REPO / "src" / "fedguide" / "guidance" / "embedded" / "weights")
    ap.add_argument("--timesteps", default=f"0,50,{PROBE_T}", help="comma-separated feature timesteps")
    ap.add_argument("--epochs", type=int, default=40, help="supervised CNN epochs over the public pool")
    ap.add_argument("--out", type=Path, default=None, help="also write the numbers to this JSON file")
    args = ap.parse_args()
    timesteps = [int(t) for t in args.timesteps.split(",")]
    from fedguide.config import GuidanceConfig
    from fedguide.guidance.model import GuidanceModel

    ds = load("fmnist")
    gm = GuidanceModel.from_config(GuidanceConfig(model=str(args.model_folder), device="cpu"))
    with torch.no_grad():
        lat = {split: torch.cat([gm.encode_image(x[i:i + 500]) for i in range(0, len(x), 500)])
               for split, x in (("pub", ds["pub_x"]), ("test", ds["test_x"]))}
    # At t = 0 the feature probe reads the clean latents (DiffusionFeatures adds no noise there).
    alpha_bar = {t: float(gm.alpha_bar(t)) if t > 0 else 1.0 for t in {*timesteps, 0, PROBE_T}}
    rows = []

    def record(kind: str, inputs: str, t: int, accuracy: float, started: float) -> None:
        rows.append({"kind": kind, "inputs": inputs, "t": t, "alpha_bar": round(alpha_bar[t], 4),
                     "accuracy": round(accuracy, 4), "seconds": round(time.time() - started)})
        print(f"{kind:10s} {inputs:34s} t={t:<4d} accuracy={accuracy:.4f}", flush=True)

    for t in timesteps:
        started = time.time()
        vectors = {split: noised(x, alpha_bar[t], sample_noise(np.arange(len(x)) + offset, x.shape[1:], 0))
                   .flatten(1).numpy() for (split, x), offset in zip(lat.items(), (0, TEST_OFFSET))}
        record("linear", "VAE latents 8x8x4 (noised)", t, linear_probe(vectors["pub"], vectors["test"], ds, f"latents t={t}"),
               started)
        started = time.time()
        record("linear", "UNet fused features (quality probe)", t, probe(gm, ds, 0, t), started)

    def standardised(size: int) -> dict[str, torch.Tensor]:
        pub, test = (F.adaptive_avg_pool2d(ds[k][:, :1], size) for k in ("pub_x", "test_x"))
        mean, std = pub.mean(), pub.std()
        return {"pub": (pub - mean) / std, "test": (test - mean) / std}

    inputs = {"VAE latents 8x8x4": lat, "pixels 16x16 (unit variance)": standardised(16),
              "pixels 32x32 (unit variance)": standardised(32)}
    for name, data in inputs.items():
        for t in (0, PROBE_T):
            started = time.time()
            acc = supervised(data["pub"], ds["pub_y"], data["test"], ds["test_y"], alpha_bar[t], args.epochs, 0)
            record("supervised", name, t, acc, started)
    if args.out is not None:
        write_text(args.out, json.dumps({"model_folder": args.model_folder.name, "epochs": args.epochs, "rows": rows},
                                        indent=1) + "\n")


if __name__ == "__main__":
    main()
