"""What a guidance pipeline's config files say without loading its weights, and the input size that follows.

Methods read these facts when they are built (``fedguide run --dry-run`` builds them), so a setting the
pipeline cannot take is refused before any weight is read: the VAE's downsampling factor (2 per VAE
block after the first: 8 for SD-1.5, 4 for the embedded and tiny pipelines), the pipeline's own image
size (the UNet's ``sample_size`` times that factor: 512 for SD-1.5, 32 for the embedded models), whether
it is an unCLIP pipeline (a projection class embedding and an image normaliser, as
stabilityai/stable-diffusion-2-1-unclip), and whether it is one of fedguide's own pretrained models
(``fedguide.json``), which were trained at a single resolution.

Input size of the diffusion features (``image_size`` of FedDifRC and SemanticFL): images are resized
to a square of ``size`` pixels before the VAE. ``paper`` is the paper's own size (FedDifRC: 224,
Sec. 4.1; SemanticFL: the data's own, Stage 1), except on fedguide's own models: trained on 32-px
images (8x8 latents) only, they always take their own size, so the embedded models give the features
they gave before the option existed. ``native`` is the data's own size, ``pipeline`` the pipeline's,
an integer that size. A size the VAE cannot take (not a multiple of its factor, or below it) is a
ConfigError naming the nearest sizes it can take.

A hub id that is not in the local cache while downloads are off yields no facts (None): the checks then
run when the model is loaded, which fails on its own with the fix.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional, Union

from fedguide.registry import ConfigError

ImageSize = Union[int, Literal["paper", "native", "pipeline"]]
# Only the config files: reading facts never downloads weights.
CONFIG_FILES = ("model_index.json", "fedguide.json", "vae/config.json", "unet/config.json",
                "image_normalizer/config.json", "image_noising_scheduler/scheduler_config.json")


@dataclass(frozen=True)
class PipelineFacts:
    vae_factor: int  # pixels per latent position along a side
    pipeline_size: int  # the images the pipeline was built for, in pixels
    unclip: bool  # image embeddings enter through a projection class embedding (SD-2.1-unCLIP)
    single_resolution: bool  # fedguide's own pretrained models: trained at pipeline_size only

    def check_image_size(self, size: int, where: str = "") -> int:
        """``size`` if the VAE can take it, else a ConfigError naming the nearest sizes it can (``where``:
        the setting it came from)."""
        factor = self.vae_factor
        if size >= factor and size % factor == 0:
            return size
        below, above = (size // factor) * factor, (size // factor + 1) * factor
        nearest = [s for s in (below, above) if s >= factor]
        raise ConfigError(f"{where or f'image size {size}'}: the pipeline's VAE downsamples by {factor}, so it "
                          f"takes sizes that are multiples of {factor} (at least {factor}); use "
                          f"{' or '.join(map(str, nearest))}")

    def resolve_image_size(self, requested: ImageSize, paper: int, data_size: int, where: str = "image_size") -> int:
        """The size images are resized to before the VAE (module docstring), checked."""
        if requested == "paper":
            size = self.pipeline_size if self.single_resolution else paper
        elif requested == "native":
            size = data_size
        elif requested == "pipeline":
            size = self.pipeline_size
        else:
            size = int(requested)
        label = f"{where}={requested}" + (f" ({size} px)" if isinstance(requested, str) else "")
        return self.check_image_size(size, label)


def read_facts(folder: Path) -> PipelineFacts:
    """The facts of a pipeline folder (its config files only)."""
    folder = Path(folder)

    def config(name: str) -> dict:
        path = folder / name
        if not path.is_file():
            return {}
        try:
            return json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise ConfigError(f"{path} cannot be read ({err}); restore the pipeline folder") from None

    vae, unet = config("vae/config.json"), config("unet/config.json")
    blocks = vae.get("block_out_channels") or [0]  # no VAE: latents are pixels
    factor = 2 ** (len(blocks) - 1)
    unclip = unet.get("class_embed_type") == "projection" and (folder / "image_normalizer").is_dir()
    return PipelineFacts(vae_factor=factor, pipeline_size=int(unet.get("sample_size") or 0) * factor, unclip=unclip,
                         single_resolution=(folder / "fedguide.json").is_file())


def pipeline_facts(cfg) -> Optional[PipelineFacts]:
    """The facts of the pipeline a GuidanceConfig names; None when they cannot be read without a download."""
    from fedguide.guidance.sources import GuidanceLoadError, resolve_source

    if cfg.model is None:
        return None
    from fedguide.guidance.oracle import INPUT_SIDE, NAME as ORACLE

    if cfg.model == ORACLE:  # no VAE; trained at one size, like fedguide's own models
        return PipelineFacts(vae_factor=1, pipeline_size=INPUT_SIDE, unclip=False, single_resolution=True)
    try:
        folder = resolve_source(cfg.model, cfg.revision, allow=CONFIG_FILES)
    except GuidanceLoadError:
        return None  # the model's own loading says what is wrong, with the fix
    return read_facts(folder)


def data_image_size(run) -> int:
    """The side of the run's training images (the data sets here are square)."""
    shape = tuple(run.data.splits.input_shape)
    if len(shape) != 3:
        raise ConfigError(f"diffusion features need images, and this data set's inputs have shape {shape}")
    return int(max(shape[1:]))
