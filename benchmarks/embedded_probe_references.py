"""What a linear probe reaches on the embedded UNet's *input*, beside the quality script's probe on its features.

    .venv/bin/python benchmarks/embedded_probe_references.py [--model-folder DIR] [--checkpoint FILE]

The same protocol as ``embedded_guidance_quality.py``'s probe (public-pool training vectors, StandardScaler,
logistic regression with C by 3-fold cross-validation on the public pool, Fashion-MNIST test set), on
- the VAE posterior means (8x8x4 = 256 values, no noise): what the UNet is given;
- the images average-pooled to 16x16 (256 values);
- the mini-CLIP image embeddings: what representation alignment to ``--repa-target clip`` pulls the UNet
  towards, so about the most that target can give (its cross-validation score on the public pool, printed
  beside, is that of embeddings trained on that very pool).
The first two are the *clean* input; the feature probe reads the UNet at t = 150, where its input is noised,
so ``embedded_probe_ceiling.py`` makes the fair comparison (the same noise on both). About 4 minutes on
two CPU cores.

With ``--checkpoint`` (the ``unet.safetensors`` checkpoint in a running ``pretrain-guidance``'s
``.<name>.partial`` folder) it prints instead the quality script's probe of that checkpoint's UNet (its EMA
weights, loaded into ``--model-folder``'s UNet in memory): an early reading of a 6000-step
attempt, about 2 minutes.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from embedded_guidance_quality import REPO, linear_probe, load, probe  # noqa: E402


def checkpoint_probe(model_folder: Path, checkpoint: Path) -> None:
    from fedguide.config import GuidanceConfig
    from fedguide.guidance.embedded.pretrain.partial import read_stage
    from fedguide.guidance.model import GuidanceModel

    state = read_stage(checkpoint)
    # The checkpoint's EMA weights go into the loaded model's UNet: nothing is written.
    gm = GuidanceModel.from_config(GuidanceConfig(model=str(model_folder), device="cpu"))
    shadow, params = state["ema"]["shadow_params"], list(gm.unet.parameters())
    if len(shadow) != len(params) or any(a.shape != b.shape for a, b in zip(params, shadow)):
        raise SystemExit(f"{checkpoint} holds a UNet of another shape than {model_folder}/unet: give the "
                         "--model-folder whose unet/ has that checkpoint's --unet-channels")
    with torch.no_grad():
        for p, s in zip(params, shadow):
            p.copy_(s)
    print(f"step {state['step']}: probe={probe(gm, load('fmnist'), 0):.4f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-folder", type=Path, default=REPO / "src" / "fedguide" / "guidance" / "embedded" / "weights")
    ap.add_argument("--checkpoint", type=Path, default=None,
                    help="a UNet checkpoint of a running pretrain-guidance (its .<name>.partial/unet.safetensors)")
    args = ap.parse_args()
    if args.checkpoint is not None:
        return checkpoint_probe(args.model_folder, args.checkpoint)
    from fedguide.config import GuidanceConfig
    from fedguide.guidance.model import GuidanceModel

    ds = load("fmnist")
    gm = GuidanceModel.from_config(GuidanceConfig(model=str(args.model_folder), device="cpu"))

    @torch.no_grad()
    def latents(x):  # posterior means; the scaling factor does not change a standardised probe
        return torch.cat([gm.encode_image(x[i:i + 500]) for i in range(0, len(x), 500)]).flatten(1).numpy()

    def pixels(x):
        return F.avg_pool2d(x[:, :1], 2).flatten(1).numpy()

    encoder = gm.image_encoder

    @torch.no_grad()
    def clip(x):
        return torch.cat([encoder.embed(x[i:i + 500]) for i in range(0, len(x), 500)]).float().numpy()

    results = {name: linear_probe(f(ds["pub_x"]), f(ds["test_x"]), ds, name)
               for name, f in (("vae_latents", latents), ("pixels_16x16", pixels), ("clip_embedding", clip))}
    print(" ".join(f"{k}={v:.4f}" for k, v in results.items()))


if __name__ == "__main__":
    main()
