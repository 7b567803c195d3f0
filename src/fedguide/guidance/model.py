"""GuidanceModel: one frozen text-to-image latent diffusion model and what the methods ask of it.

It holds the diffusers/transformers components (VAE, UNet, text encoder + tokenizer, the scheduler's
config, optionally a CLIP image encoder and the unCLIP image-noising parts) and exposes the few
operations every diffusion-guided method is built from: text and image encoding, noising, one UNet
prediction with any conditioning, x̂₀ from ε, decoding. Feature hooks (hooks.py), fused features
(fused.py) and samplers (samplers.py) are built on these.

Conventions: images are float tensors in [-1, 1], shape [B, 3, H, W]; latents are the VAE's latents
already multiplied by its ``scaling_factor`` (0.18215 for SD-1.5), as the UNet was trained on them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F

from fedguide.guidance.components import load_components
from fedguide.registry import ConfigError


@dataclass
class TextEmbedding:
    tokens: torch.Tensor  # [B, L, H] cross-attention context
    pooled: torch.Tensor  # [B, H] one vector per prompt
    mask: torch.Tensor  # [B, L] 1 for real tokens

    def repeat(self, n: int) -> "TextEmbedding":
        return TextEmbedding(self.tokens.repeat_interleave(n, 0), self.pooled.repeat_interleave(n, 0),
                             self.mask.repeat_interleave(n, 0))

    def index(self, idx: torch.Tensor | Sequence[int]) -> "TextEmbedding":
        idx = torch.as_tensor(idx, device=self.tokens.device, dtype=torch.long)
        return TextEmbedding(self.tokens[idx], self.pooled[idx], self.mask[idx])


class GuidanceModel:
    def __init__(self, unet, text_encoder, tokenizer, scheduler_config: dict, vae=None, image_encoder=None,
                 image_normalizer=None, image_noising_scheduler=None, model_id: str = "",
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 image_token_scale: Optional[float] = None):
        self.device = torch.device(device)
        self.dtype = dtype
        self.unet = self._frozen(unet)
        self.text_encoder = self._frozen(text_encoder)
        self.vae = self._frozen(vae) if vae is not None else None
        self.image_normalizer = self._frozen(image_normalizer) if image_normalizer is not None else None
        self.image_noising_scheduler = image_noising_scheduler
        self.image_encoder = image_encoder
        self.tokenizer = tokenizer
        self.scheduler_config = dict(scheduler_config)
        self.model_id = model_id
        # Token-conditioned models (the embedded one) read the image embedding as one extra context token,
        # L2-normalised and scaled to the text tokens' size; its slot is zero when no image is given.
        self.image_token_scale = image_token_scale
        from diffusers import DDPMScheduler

        # The noise schedule of training, for noising and x̂₀; samplers build their own stepping scheduler.
        self.noise_scheduler = DDPMScheduler.from_config(self.scheduler_config)
        self._alphas = self.noise_scheduler.alphas_cumprod.to(self.device, torch.float32)
        self._text_cache: dict[tuple[str, ...], TextEmbedding] = {}

    @classmethod
    def from_config(cls, cfg) -> "GuidanceModel":
        """The model a GuidanceConfig describes."""
        return cls(**load_components(cfg))

    def _frozen(self, module):
        # Cast only when needed: diffusers warns on a dtype cast of a model loaded in its dtype.
        module.to(self.device)
        if any(p.dtype != self.dtype for p in module.parameters()):
            module.to(dtype=self.dtype)
        module.eval()
        module.requires_grad_(False)
        return module

    # --- facts -------------------------------------------------------------------------------------
    @property
    def context_dim(self) -> int:
        return int(self.unet.config.cross_attention_dim)

    @property
    def latent_channels(self) -> int:
        return int(self.unet.config.in_channels)

    @property
    def latent_size(self) -> int:
        return int(self.unet.config.sample_size)

    @property
    def image_size(self) -> int:
        return self.latent_size * self.vae_scale

    @property
    def vae_scale(self) -> int:
        if self.vae is None:
            return 1
        return 2 ** (len(self.vae.config.block_out_channels) - 1)

    @property
    def scaling_factor(self) -> float:
        return float(self.vae.config.scaling_factor) if self.vae is not None else 1.0

    @property
    def num_train_timesteps(self) -> int:
        return int(self.noise_scheduler.config.num_train_timesteps)

    @property
    def is_unclip(self) -> bool:
        return self.unet.config.class_embed_type == "projection" and self.image_normalizer is not None

    @property
    def image_conditioning(self) -> Optional[str]:
        """How an image embedding conditions the UNet: 'unclip' (class labels), 'token' or None."""
        if self.is_unclip:
            return "unclip"
        return "token" if self.image_token_scale is not None else None

    def alpha_bar(self, t: torch.Tensor | int) -> torch.Tensor:
        t = torch.as_tensor(t, device=self.device, dtype=torch.long)
        # A gather, not ``self._alphas[t]``: indexing with a 0-dim tensor reads its value on the host, a wait
        # for the device at every sampler step.
        return self._alphas.index_select(0, t.reshape(-1)).reshape(t.shape)

    # --- text --------------------------------------------------------------------------------------
    @torch.no_grad()
    def encode_text(self, prompts: Sequence[str]) -> TextEmbedding:
        """Token embeddings (the cross-attention context) and a pooled vector per prompt (cached)."""
        key = tuple(prompts)
        if key not in self._text_cache:
            max_len = min(self.tokenizer.model_max_length,
                          getattr(self.text_encoder.config, "max_position_embeddings", 10 ** 6))
            enc = self.tokenizer(list(prompts), padding="max_length", max_length=max_len, truncation=True,
                                 return_tensors="pt").to(self.device)
            out = self.text_encoder(input_ids=enc.input_ids, attention_mask=enc.attention_mask)
            tokens = out.last_hidden_state.to(self.dtype)
            mask = enc.attention_mask.to(self.dtype)
            if self.text_encoder.config.model_type.startswith("clip"):
                pooled = out.pooler_output  # CLIP: the end-of-text token's state
            else:  # sentence encoders (MiniLM): the mean over real tokens
                pooled = (tokens * mask[..., None]).sum(1) / mask.sum(1, keepdim=True).clamp_min(1)
            if self.image_conditioning == "token":
                tokens = torch.cat([tokens, torch.zeros_like(tokens[:, :1])], dim=1)
                mask = torch.cat([mask, torch.zeros_like(mask[:, :1])], dim=1)
            if tokens.shape[-1] != self.context_dim:
                raise ConfigError(f"the text encoder's hidden size {tokens.shape[-1]} differs from the UNet's "
                                  f"cross_attention_dim {self.context_dim}; use the pipeline's own text encoder")
            self._text_cache[key] = TextEmbedding(tokens, pooled.to(self.dtype), mask)
        return self._text_cache[key]

    def empty_text(self, n: int) -> TextEmbedding:
        return self.encode_text([""]).repeat(n)

    # --- images and latents ------------------------------------------------------------------------
    def _check_images(self, x: torch.Tensor, size: Optional[int] = None) -> torch.Tensor:
        if x.ndim != 4 or x.shape[1] not in (1, 3):
            raise ConfigError(f"images must be [B, 3, H, W] in [-1, 1], got shape {tuple(x.shape)}")
        if x.shape[1] == 1:
            x = x.expand(-1, 3, -1, -1)  # grey-scale datasets (MNIST, FMNIST) as RGB
        size = self.image_size if size is None else int(size)
        if size < self.vae_scale or size % self.vae_scale:
            raise ConfigError(f"image size {size}: the VAE downsamples by {self.vae_scale}, so sizes must be "
                              f"multiples of {self.vae_scale}")
        if x.shape[-1] != size or x.shape[-2] != size:
            x = F.interpolate(x.float(), size=(size, size), mode="bilinear", align_corners=False)
        return x.to(self.device, self.dtype)

    def encode_image(self, x: torch.Tensor, sample: bool = False, generator: torch.Generator | None = None,
                     size: Optional[int] = None) -> torch.Tensor:
        """VAE latents times the VAE's scaling factor; the posterior mean unless ``sample``. Images are
        resized to ``size`` x ``size`` pixels first (None: the pipeline's own ``image_size``)."""
        if self.vae is None:
            raise ConfigError("this guidance model has no VAE (vae/ folder); latent features need one")
        dist = self.vae.encode(self._check_images(x, size)).latent_dist
        latents = dist.sample(generator) if sample else dist.mean
        return latents * self.scaling_factor

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents (scaled) -> images in [-1, 1]; differentiable (classifier guidance backpropagates it)."""
        if self.vae is None:
            raise ConfigError("this guidance model has no VAE (vae/ folder) to decode with")
        return self.vae.decode(latents.to(self.dtype) / self.scaling_factor).sample.clamp(-1, 1)

    def add_noise(self, latents: torch.Tensor, t: torch.Tensor | int, noise: torch.Tensor | None = None,
                  generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """q(x_t | x_0) with the pipeline's training schedule; returns (noisy latents, the noise)."""
        if noise is None:
            noise = torch.randn(latents.shape, generator=generator, device=generator.device if generator else None,
                                dtype=latents.dtype).to(latents.device)
        t = torch.as_tensor(t, device=latents.device, dtype=torch.long).expand(latents.shape[0])
        return self.noise_scheduler.add_noise(latents, noise, t), noise

    def predict_x0(self, latents: torch.Tensor, t: torch.Tensor | int, eps: torch.Tensor) -> torch.Tensor:
        """x̂₀ = (x_t − √(1−ᾱ_t) ε) / √ᾱ_t (FedCADO Eq. 3)."""
        a = self.alpha_bar(t).to(latents.dtype)
        a = a.view(-1, *([1] * (latents.ndim - 1))) if a.ndim else a
        return (latents - (1 - a).sqrt() * eps) / a.sqrt()

    # --- conditioning ---------------------------------------------------------------------------------
    def _need_unclip(self) -> None:
        if not self.is_unclip:
            raise ConfigError("image-embedding conditioning needs an unCLIP model (e.g. "
                              "stabilityai/stable-diffusion-2-1-unclip: a UNet with a projection class embedding "
                              "and image_normalizer/); this guidance model has none")

    @property
    def image_noise_steps(self) -> int:
        """Levels of the unCLIP image-noising scheduler (its config's ``num_train_timesteps``)."""
        self._need_unclip()
        return int(self.image_noising_scheduler.config.num_train_timesteps)

    def image_noise_alpha_bar(self, level: int) -> float:
        """ᾱ of the unCLIP image-noising scheduler at ``level``, read from the loaded scheduler."""
        if not 0 <= level < self.image_noise_steps:
            raise ConfigError(f"image noise level {level} is outside the image-noising scheduler's "
                              f"[0, {self.image_noise_steps})")
        return float(self.image_noising_scheduler.alphas_cumprod[int(level)])

    def noise_image_embeds(self, embeds: torch.Tensor, noise_level: int, noise: Optional[torch.Tensor] = None,
                           generator: torch.Generator | None = None) -> torch.Tensor:
        """unCLIP's noising of image embeddings: standardised by the image normaliser, noised by the
        image-noising scheduler's ``add_noise`` at ``noise_level``, unstandardised (the pipeline's own steps).
        Level 0 without a given ``noise`` adds none (a clean embedding, deterministic)."""
        self._need_unclip()
        embeds = embeds.to(self.device, self.dtype)
        level = torch.full((embeds.shape[0],), noise_level, device=self.device, dtype=torch.long)
        scaled = self.image_normalizer.scale(embeds)
        if noise_level > 0 or noise is not None:
            if noise is None:
                noise = torch.randn(scaled.shape, generator=generator, dtype=scaled.dtype,
                                    device=generator.device if generator else None)
            scaled = self.image_noising_scheduler.add_noise(scaled, noise.to(self.device, scaled.dtype), level)
        return self.image_normalizer.unscale(scaled)

    def image_condition(self, embeds: torch.Tensor, noise_level: int = 0, generator: torch.Generator | None = None,
                        noised: bool = False) -> torch.Tensor:
        """unCLIP class labels: image embeddings noised to ``noise_level`` (``noise_image_embeds``; taken as
        they are when ``noised``, i.e. already noised to that level) and the level's sinusoidal embedding."""
        self._need_unclip()
        from diffusers.models.embeddings import get_timestep_embedding

        embeds = embeds.to(self.device, self.dtype)
        if not noised:
            embeds = self.noise_image_embeds(embeds, noise_level, generator=generator)
        level = torch.full((embeds.shape[0],), noise_level, device=self.device, dtype=torch.long)
        level_emb = get_timestep_embedding(level, embeds.shape[-1], flip_sin_to_cos=True, downscale_freq_shift=0)
        return torch.cat([embeds, level_emb.to(embeds.dtype)], dim=1)

    def condition_inputs(self, context: torch.Tensor, image_embeds: Optional[torch.Tensor] = None,
                         noise_level: int = 0, generator: torch.Generator | None = None, noised: bool = False
                         ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(context, class labels) for a UNet pass conditioned on text and, optionally, image embeddings
        (``noise_level`` and ``noised``: see ``image_condition``; unCLIP models only)."""
        kind = self.image_conditioning
        if kind == "unclip":
            if image_embeds is None:
                image_embeds = torch.zeros(context.shape[0], self.image_normalizer.mean.shape[-1])
            return context, self.image_condition(image_embeds, noise_level, generator, noised)
        if image_embeds is None:
            return context, None
        if kind is None:
            raise ConfigError("this guidance model takes no image conditioning (it is neither an unCLIP model nor "
                              "token-conditioned like the embedded one)")
        if noise_level or noised:
            raise ConfigError("a noise level of the image embedding is an unCLIP input; this guidance model reads "
                              "the embedding as a context token and takes none")
        token = F.normalize(image_embeds.to(context.device, context.dtype), dim=-1) * self.image_token_scale
        if token.shape[-1] != context.shape[-1]:
            raise ConfigError(f"image embeddings have {token.shape[-1]} dims, the context {context.shape[-1]}")
        return torch.cat([context[:, :-1], token[:, None]], dim=1), None

    def block_maps(self, latents: torch.Tensor, t: torch.Tensor | int, context: torch.Tensor,
                   layers: Sequence[str], class_labels: Optional[torch.Tensor] = None) -> dict[str, torch.Tensor]:
        """Activations of the UNet blocks ``layers`` (hooks.py names) for one pass; the pass stops after the last."""
        from fedguide.guidance.hooks import hooked_features

        return hooked_features(self, latents, t, context, layers, class_labels=class_labels)

    def eps(self, latents: torch.Tensor, t: torch.Tensor | int, context: torch.Tensor,
            class_labels: Optional[torch.Tensor] = None, **unet_kwargs: Any) -> torch.Tensor:
        """One UNet noise prediction ε_θ(x_t, t | context[, class labels])."""
        t = torch.as_tensor(t, device=self.device)
        if t.ndim == 0:
            t = t.expand(latents.shape[0])
        out = self.unet(latents.to(self.dtype), t, encoder_hidden_states=context.to(self.dtype),
                        class_labels=class_labels, **unet_kwargs)
        return out.sample
