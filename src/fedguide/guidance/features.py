"""Diffusion features of images: noised VAE latents through the UNet, hooked, fused, cached.

``DiffusionFeatures`` ties the pieces together for the methods: it encodes images to latents, noises
them to timestep ``t`` (t = 0: the clean latents, FedDifRC's conditional representations), runs the
UNet with a text context (one prompt per image) and an optional extra condition, captures the chosen
blocks (hooks.py) and fuses them to one vector per image with a fitted recipe (fused.py). Features of a
whole dataset are computed once through the FeatureStore (store.py).

Decisions
- The noise of sample i depends only on (noise_seed, i), never on its batch mates or the batch size,
  so a cached feature can be recomputed exactly and a client extracting its own features (SemanticFL
  ``extraction_site: client``) gets the server's numbers.
- The recipe is fitted once (``fit_or_load``) and saved; its fitted bases are hashed into the cache
  key, so features made with another basis are never mixed with these.
- Prompts are encoded once per distinct prompt (class prompts), not once per image.
"""
from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from fedguide.guidance.condition import ConditionMap, ConditionMode, inject
from fedguide.guidance.hooks import unet_features
from fedguide.guidance.store import CHUNK_ITEMS, FeatureKey, FeatureStore
from fedguide.registry import ConfigError


@dataclass(frozen=True)
class FeatureSpec:
    """How the UNet is run: which blocks, at which timestep, with which noise, on images of which size."""

    layers: tuple[str, ...]
    t: int = 150
    noise_seed: int = 0
    condition_mode: ConditionMode = "none"
    extra: dict = field(default_factory=dict)  # anything else the caller's features depend on
    image_size: Optional[int] = None  # images are resized to this square before the VAE; None: the pipeline's

    def as_dict(self) -> dict:
        d = asdict(self)
        d["layers"] = list(self.layers)
        return d


def sample_noise(indices: Sequence[int] | np.ndarray, shape: Sequence[int], seed: int) -> torch.Tensor:
    """Gaussian noise [len(indices), *shape]; row i depends on (seed, indices[i]) alone."""
    out = torch.empty(len(indices), *shape)
    for row, i in enumerate(np.asarray(indices).tolist()):
        out[row] = torch.randn(*shape, generator=torch.Generator().manual_seed(seed * 1_000_003 + int(i)))
    return out


def basis_hash(recipe) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(recipe.state_dict().items()):
        digest.update(name.encode() + tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


class DiffusionFeatures:
    def __init__(self, model, spec: FeatureSpec, recipe=None, condition_map: Optional[ConditionMap] = None):
        if spec.condition_mode != "none" and condition_map is None:
            raise ConfigError(f"condition_mode={spec.condition_mode} needs a condition map (the condition vectors' "
                              "size decides it)")
        if spec.t < 0 or spec.t >= model.num_train_timesteps:
            raise ConfigError(f"feature timestep t={spec.t} is outside the model's [0, {model.num_train_timesteps})")
        self.model, self.spec, self.recipe, self.condition_map = model, spec, recipe, condition_map

    # --- maps -------------------------------------------------------------------------------------
    def contexts(self, prompts: Sequence[str]) -> torch.Tensor:
        unique = sorted(set(prompts))
        tokens = self.model.encode_text(tuple(unique)).tokens
        where = {p: i for i, p in enumerate(unique)}
        return tokens[torch.tensor([where[p] for p in prompts], device=tokens.device)]

    @torch.no_grad()
    def maps(self, images: torch.Tensor, prompts: Sequence[str], indices: Sequence[int] | np.ndarray,
             condition: Optional[torch.Tensor] = None, class_labels: Optional[torch.Tensor] = None) -> dict[str, torch.Tensor]:
        """UNet activations of the spec's layers for a batch of images in [-1, 1]."""
        if not (len(images) == len(prompts) == len(indices)):
            raise ConfigError(f"{len(images)} images, {len(prompts)} prompts and {len(indices)} indices: one each")
        latents = self.model.encode_image(images, size=self.spec.image_size)
        if self.spec.t > 0:
            noise = sample_noise(indices, latents.shape[1:], self.spec.noise_seed).to(latents.device, latents.dtype)
            latents, _ = self.model.add_noise(latents, self.spec.t, noise=noise)
        context = inject(self.contexts(prompts), condition, self.spec.condition_mode, self.condition_map)
        return unet_features(self.model, latents, self.spec.t, context, self.spec.layers, class_labels=class_labels)

    # --- fitting the recipe ------------------------------------------------------------------------
    def _batches(self, images, prompts, indices, batch_size):
        for start in range(0, len(images), batch_size):
            sl = slice(start, start + batch_size)
            yield self.maps(images[sl], prompts[sl], np.asarray(indices)[sl])

    def fit(self, images: torch.Tensor, prompts: Sequence[str], indices: Sequence[int], batch_size: int = 32):
        self._need_recipe().fit(self._batches(images, prompts, indices, batch_size))
        return self

    def fit_or_load(self, path: Path, images_fn: Callable[[], tuple[torch.Tensor, Sequence[str], Sequence[int]]],
                    batch_size: int = 32):
        """Loads the fitted recipe from ``path`` if there, else fits it on ``images_fn()`` and saves it."""
        recipe = self._need_recipe()
        path = Path(path)
        if path.exists():
            loaded = type(recipe).load(path)
            if loaded.recipe() != recipe.recipe():
                raise ConfigError(f"fitted features {path} were made with recipe {loaded.recipe()}, this run asks "
                                  f"for {recipe.recipe()}; delete the file or rerun with --rebuild")
            self.recipe = loaded
        else:
            self.fit(*images_fn(), batch_size=batch_size)
            path.parent.mkdir(parents=True, exist_ok=True)
            recipe.save(path)
        return self

    def _need_recipe(self):
        if self.recipe is None:
            raise ConfigError("these diffusion features have no fusion recipe (FusedFeatures or PooledPCAFeatures)")
        return self.recipe

    # --- vectors -----------------------------------------------------------------------------------
    def __call__(self, images: torch.Tensor, prompts: Sequence[str], indices: Sequence[int] | np.ndarray,
                 condition: Optional[torch.Tensor] = None, class_labels: Optional[torch.Tensor] = None) -> torch.Tensor:
        with torch.no_grad():
            return self._need_recipe()(self.maps(images, prompts, indices, condition, class_labels)).float()

    def key(self, dataset: str, split: str, fraction: float = 1.0, seed: int = 0, **extra) -> FeatureKey:
        recipe = self._need_recipe()
        return FeatureKey(model=self.model.model_id, dataset=dataset, split=split, fraction=fraction, seed=seed,
                          recipe={"spec": self.spec.as_dict(), "fusion": recipe.recipe(),
                                  "basis": basis_hash(recipe), **extra})

    def dataset(self, store: FeatureStore, key: FeatureKey, images: torch.Tensor, prompts: Sequence[str],
                batch_size: int = 32, rebuild: bool = False, progress: bool = True,
                chunk_size: int = CHUNK_ITEMS) -> np.ndarray:
        """[N, d] features of ``images`` (index i = sample i, for the noise seed), computed once, cached;
        an interrupted extraction resumes from its finished chunks of ``chunk_size`` items."""
        if key.model != self.model.model_id:
            raise ConfigError(f"feature key is for model {key.model}, these features come from {self.model.model_id}")

        def compute(idx: np.ndarray) -> torch.Tensor:
            return self(images[idx], [prompts[i] for i in idx], idx).cpu()

        return store.get_or_compute(key, len(images), compute, batch_size=batch_size, rebuild=rebuild,
                                    description="diffusion features", progress=progress, chunk_size=chunk_size)
