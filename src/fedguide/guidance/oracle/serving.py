"""The oracle behind the interfaces the methods read: ``OracleGuidance`` answers GuidanceModel's feature calls
(text embeddings, "latents", noising, block features, facts such as the context size and noise schedule)
and ``OracleEncoder`` ClipImageEncoder's (embeddings, text embeddings, zero-shot scores).

What each call returns is in the package docstring. Sampling calls (``eps``, ``decode``, ``predict_x0``) and
image-embedding conditioning raise a ConfigError: the oracle has no diffusion model. The noise schedule is
SD-1.5's (the embedded models' too), kept so that settings read as numbers (FedDifRC's and SemanticFL's
``t: paper``, FedDISC-family centroid noise) resolve as on the embedded models; the oracle's own features
are never noised.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from fedguide.guidance.hooks import layer_parts
from fedguide.guidance.model import TextEmbedding
from fedguide.guidance.oracle import GENERATION_REFUSED, INPUT_SIDE, NAME
from fedguide.guidance.oracle.network import oracle_input
from fedguide.guidance.oracle.training import TrainedOracle
from fedguide.registry import ConfigError

BLOCKS = 4  # down and up blocks a method may name, as on SD's and the embedded UNets (FedDifRC's layers 1-4)


def prompt_class(prompt: str, class_names: Sequence[str]) -> Optional[int]:
    """The class a prompt names: the class name itself or a prompt ending in it as a word ("a photo of a
    {class}"); the longest such name wins ("woman" over "man"); None when it names none."""
    text = prompt.strip().lower()
    found = [(len(name), c) for c, name in enumerate(class_names)
             if text == name or text.endswith(" " + name)]
    return max(found)[1] if found else None


def _schedule():
    from diffusers import DDPMScheduler

    from fedguide.guidance.timesteps import SD15_SCHEDULE

    return DDPMScheduler(**SD15_SCHEDULE)


class OracleGuidance:
    # No UNet, VAE, text encoder or unCLIP parts: whatever would read them (a UNet's block channels) finds
    # none, and whatever would sample with them is refused.
    unet = vae = text_encoder = tokenizer = image_normalizer = image_noising_scheduler = None
    image_token_scale = None
    is_unclip = False
    image_conditioning = None
    vae_scale = 1
    scaling_factor = 1.0
    latent_channels = 3
    latent_size = image_size = INPUT_SIDE

    def __init__(self, trained: TrainedOracle, class_names: Sequence[str], model_id: str, record: dict,
                 device: torch.device | str = "cpu"):
        self.device, self.dtype = torch.device(device), torch.float32
        self.net = trained.net.to(self.device)
        self.prototypes = trained.prototypes.to(self.device, self.dtype)
        self.class_names = [name.lower() for name in class_names]
        self.model_id, self.record = model_id, record
        self.noise_scheduler = _schedule()
        self.scheduler_config = dict(self.noise_scheduler.config)
        self._alphas = self.noise_scheduler.alphas_cumprod.to(self.device, torch.float32)
        self._text_cache: dict[tuple[str, ...], TextEmbedding] = {}
        self.image_encoder = OracleEncoder(self)

    # --- facts ---------------------------------------------------------------------------------------
    @property
    def width(self) -> int:
        return int(self.prototypes.shape[1])

    @property
    def context_dim(self) -> int:
        return self.width  # a prompt's one context token is its class prototype

    @property
    def num_train_timesteps(self) -> int:
        return int(self.noise_scheduler.config.num_train_timesteps)

    def alpha_bar(self, t: torch.Tensor | int) -> torch.Tensor:
        t = torch.as_tensor(t, device=self.device, dtype=torch.long)
        return self._alphas.index_select(0, t.reshape(-1)).reshape(t.shape)

    # --- text ------------------------------------------------------------------------------------------
    def text_vectors(self, prompts: Sequence[str], strict: bool = False) -> torch.Tensor:
        """[P, width]: each prompt's class prototype, zeros for a prompt naming no class (``strict``: refused)."""
        rows = []
        for prompt in prompts:
            c = prompt_class(prompt, self.class_names)
            if c is None and strict:
                raise ConfigError(f"guidance.model=oracle embeds a prompt as the prototype of the class it names, and "
                                  f"'{prompt}' names none of {self.class_names}; use prompts of the form "
                                  "'a photo of a {class}'")
            rows.append(self.prototypes[c] if c is not None else torch.zeros_like(self.prototypes[0]))
        return torch.stack(rows) if rows else self.prototypes[:0]

    def encode_text(self, prompts: Sequence[str]) -> TextEmbedding:
        """One context token per prompt, its class prototype (zeros: no class); pooled: the same vector."""
        key = tuple(prompts)
        if key not in self._text_cache:
            vectors = self.text_vectors(prompts)
            self._text_cache[key] = TextEmbedding(vectors[:, None, :], vectors, torch.ones_like(vectors[:, :1]))
        return self._text_cache[key]

    def empty_text(self, n: int) -> TextEmbedding:
        return self.encode_text([""]).repeat(n)

    # --- images ----------------------------------------------------------------------------------------
    def encode_image(self, x: torch.Tensor, sample: bool = False, generator: torch.Generator | None = None,
                     size: Optional[int] = None) -> torch.Tensor:
        """The oracle's "latents": the images in its input form (32 x 32 RGB); it reads no other size."""
        if size is not None and int(size) != INPUT_SIDE:
            raise ConfigError(f"guidance.model=oracle reads images at {INPUT_SIDE} px only (its training size), and "
                              f"this method asks for {size} px; set method.image_size=paper or pipeline")
        return oracle_input(x).to(self.device)

    def add_noise(self, latents: torch.Tensor, t, noise: torch.Tensor | None = None,
                  generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The latents unchanged: the oracle's features are the same at every timestep."""
        return latents, (torch.zeros_like(latents) if noise is None else noise)

    def condition_inputs(self, context: torch.Tensor, image_embeds: Optional[torch.Tensor] = None,
                         noise_level: int = 0, generator: torch.Generator | None = None, noised: bool = False
                         ) -> tuple[torch.Tensor, None]:
        if image_embeds is not None or noise_level or noised:
            raise ConfigError("guidance.model=oracle takes no image-embedding conditioning; use "
                              "guidance.model=embedded or an unCLIP pipeline for it")
        return context, None

    @torch.no_grad()
    def block_maps(self, latents: torch.Tensor, t, context: torch.Tensor, layers: Sequence[str],
                   class_labels: Optional[torch.Tensor] = None) -> dict[str, torch.Tensor]:
        """f(x) + the prompt's vector (the context's first token; a condition appended after it is not read) as a
        [B, width, 1, 1] map under every requested block name; the same for every t."""
        for name in layers:
            kind, index, _ = layer_parts(name)
            if kind != "mid" and index >= BLOCKS:
                raise ConfigError(f"layer '{name}': the oracle answers to {BLOCKS} {kind} blocks (0..{BLOCKS - 1})")
        features = self.net.features(latents.to(self.device, self.dtype))
        if context.shape[-1] != self.width:
            raise ConfigError(f"a context of {context.shape[-1]} dims reached the oracle, whose prompt vectors have "
                              f"{self.width}")
        maps = (features + context[:, 0].to(features.dtype))[:, :, None, None]
        return {name: maps for name in layers}

    # --- sampling: none ---------------------------------------------------------------------------------
    def _refuse(self, *args, **kwargs):
        raise ConfigError(GENERATION_REFUSED.format(who="this method"))

    eps = decode = predict_x0 = image_condition = noise_image_embeds = _refuse


class OracleEncoder:
    """ClipImageEncoder's interface on the oracle: embeddings are f(x), text embeddings the class prototypes, so
    zero-shot classification is the nearest class mean of the pool."""

    source = NAME
    size = INPUT_SIDE
    can_zero_shot = True

    def __init__(self, oracle: OracleGuidance):
        self.oracle = oracle
        self.device, self.dtype = oracle.device, oracle.dtype

    @property
    def dim(self) -> int:
        return self.oracle.width

    def preprocess(self, x: torch.Tensor) -> torch.Tensor:
        return oracle_input(x).to(self.device)

    def embed(self, x: torch.Tensor, normalize: bool = False) -> torch.Tensor:
        emb = self.oracle.net.features(self.preprocess(x))
        return F.normalize(emb, dim=-1) if normalize else emb

    @torch.no_grad()
    def embed_text(self, prompts: Sequence[str], normalize: bool = True) -> torch.Tensor:
        emb = self.oracle.text_vectors(prompts, strict=True)
        return F.normalize(emb, dim=-1) if normalize else emb

    @torch.no_grad()
    def zero_shot(self, x: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        return self.embed(x, normalize=True) @ self.embed_text(prompts).T
