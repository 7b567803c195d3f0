"""What the diffusion-guided local objectives (FedDifRC, SemanticFL, the feature-alignment baseline) share:
per-sample features of the clients' training images, computed once on the server and looked up by the
global sample indices of a batch (``ctx.batch_indices``).

This file holds
- ``training_rows`` / ``RowLookup``: the samples features are made for (every sample some client trains
  on, sorted) and the map from global sample indices to rows of a cached array;
- ``guidance_images``: training images in the [-1, 1] range the guidance models take;
- ``prompt_maps`` / ``prompt_vectors``: UNet activations, then fused vectors, of each image under several
  prompts (FedDifRC needs every class prompt per image). The VAE encodes an image once, its noise is drawn
  once from its sample index, and all its prompts run as one UNet batch;
- ``fit_basis``: the PCA basis of a fusion recipe, fitted once on the server and reused: first the copy in
  the run directory (resume, worker processes), then a copy in the feature cache keyed by everything the
  fit depends on (a second run with the same cache runs no UNet pass), else fitted and saved to both;
- ``cached_features``: an array [rows, ...] through the FeatureStore (memory-mapped, validated, with a
  progress bar) under a key that holds the dataset name, split, data settings (fraction, public pool,
  root), the digest of the sample set, the prompts and everything the recipe depends on;
- ``fit_sample``: the images a basis is fitted on: the public pool when ``data.public_fraction > 0``,
  else a seeded sample of the clients' training images (which then reach the server; the record says so);
- ``GuidanceRecord``: ``<run dir>/guidance/<method>.json``, what a method's setup did (fit source,
  extraction site, input size, seconds, cache folders; with ``guidance.model: oracle``, the oracle's
  network, pool and accuracies under ``guidance_source``), written by the first process to set the method up;
- ``input_size``: the side images are resized to before the VAE, from a method's ``image_size`` (the
  rules are in guidance/pipeline_facts.py), checked when the method is built (``--dry-run``).

Decisions
- Features are made for the union of the clients' samples, not the whole training split: a run on
  ``data.fraction`` 0.05 extracts 5 % of the images. The sample set changes with the run seed (the
  fraction is drawn per seed), so its digest is in the key.
- Prompt contexts are encoded once per prompt list and indexed per image, so the text encoder's per-tuple
  cache holds one entry per method, whatever the batches look like.
- ``guidance.rebuild`` recomputes only in the first process that sets the method up (the one that writes
  the record); worker processes and resumed runs reuse what it made.
"""
from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import numpy as np
import torch

from fedguide.core.atomic import write_json
from fedguide.core.device import computes_on_host
from fedguide.guidance.condition import inject
from fedguide.guidance.features import DiffusionFeatures, sample_noise
from fedguide.guidance.pipeline_facts import ImageSize, data_image_size, pipeline_facts
from fedguide.guidance.progress import progress
from fedguide.guidance.shared import guidance_pixels, source_record
from fedguide.guidance.store import FeatureKey, FeatureStore
from fedguide.registry import ConfigError

log = logging.getLogger("fedguide.guidance")


# ---- samples and rows --------------------------------------------------------------------------------
def training_rows(run) -> np.ndarray:
    """Sorted global indices of every sample some client trains on (the rows of the cached arrays)."""
    parts = [np.asarray(idx, dtype=np.int64) for idx in run.data.client_indices if len(idx)]
    if not parts:
        raise ConfigError("no client holds any training sample; check data.fraction and the partition")
    return np.unique(np.concatenate(parts))


def digest(indices: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(indices, dtype=np.int64).tobytes()).hexdigest()[:16]


class RowLookup:
    """Global sample indices -> rows of an array made for ``indices`` (in that order)."""

    def __init__(self, indices: np.ndarray):
        self.indices = np.asarray(indices, dtype=np.int64)
        self.order = np.argsort(self.indices, kind="stable")
        self.sorted = self.indices[self.order]

    def __call__(self, batch: Any) -> np.ndarray:
        if batch is None:
            raise RuntimeError("ctx.batch_indices is not set: this method looks up per-sample features by the "
                               "global indices the local loop sets before calling local_loss")
        wanted = np.asarray(batch.cpu() if torch.is_tensor(batch) else batch, dtype=np.int64)
        pos = np.clip(np.searchsorted(self.sorted, wanted), 0, len(self.sorted) - 1)
        if not np.array_equal(self.sorted[pos], wanted):
            missing = wanted[self.sorted[pos] != wanted][:5].tolist()
            raise RuntimeError(f"samples {missing} have no precomputed features; features were made for "
                               f"{len(self.indices)} other samples")
        return self.order[pos]


def lookup(array: np.ndarray, rows: np.ndarray) -> torch.Tensor:
    """Rows of a (memory-mapped) array as a float32 tensor."""
    return torch.from_numpy(np.ascontiguousarray(array[rows], dtype=np.float32))


class ClientPositions:
    """Global sample index -> position among one client's samples, as a table on the run's device, built once
    per round; a batch's positions are then one device-side gather of the loop's device batch indices
    (``ctx.batch_device_indices``), with no host lookup, copy or sync per step."""

    def __init__(self, client_indices: torch.Tensor, num_samples: int, device: torch.device):
        own = torch.as_tensor(client_indices, dtype=torch.long).to(device)
        self.table = torch.zeros(num_samples, dtype=torch.long, device=device)
        self.table[own] = torch.arange(len(own), device=device)

    def __call__(self, ctx) -> torch.Tensor:
        idx = ctx.batch_device_indices
        if idx is None:  # a loop without device data (a test's own loop): the host indices, moved
            if ctx.batch_indices is None:
                raise RuntimeError("ctx.batch_indices is not set: this method looks up per-sample features by the "
                                   "global indices the local loop sets before calling local_loss")
            idx = torch.as_tensor(ctx.batch_indices, dtype=torch.long).to(self.table.device)
        return self.table[idx]


class ClientTargets:
    """One client's rows of a per-sample feature cache (memory-mapped, all training samples) for a round. On a
    GPU (or the simulated device) they are gathered and moved once, in ``begin_local``, and looked up per batch
    on the device: no host gather, copy or sync per step. On the CPU each batch's rows are gathered from the
    cache as they are needed: there is nothing to move, and one gather of a whole client per round (a fresh
    block of memory every round) measured slower than the batches' small ones (benchmarks/target_lookup.py).
    Both give the same float32 rows."""

    def __init__(self, array: np.ndarray, rows: RowLookup, ctx, num_samples: int, device: torch.device):
        self.array, self.rows = array, rows
        self.on_host = computes_on_host(device)
        if not self.on_host:
            indices = ctx.data.indices
            self.values = lookup(array, rows(indices.numpy())).to(device)
            self.positions = ClientPositions(indices, num_samples, device)

    def __call__(self, ctx) -> torch.Tensor:
        if self.on_host:
            return lookup(self.array, self.rows(ctx.batch_indices))
        return self.values[self.positions(ctx)]


def guidance_images(run, indices: np.ndarray) -> torch.Tensor:
    """Training images of ``indices`` in [-1, 1]."""
    return guidance_pixels(run.data.splits, run.data.splits.train_x[torch.as_tensor(indices, dtype=torch.long)])


def fit_sample(run, n: int, seed: int) -> tuple[np.ndarray, str]:
    """(sorted indices, description) of at most ``n`` images to fit a basis on."""
    public = np.asarray(run.data.public_indices, dtype=np.int64)
    if run.data_settings.public_fraction > 0 and len(public):
        pool, source = public, "the public pool (data.public_fraction)"
    else:
        pool, source = training_rows(run), ("a seeded sample of the clients' training images (they reach the "
                                            "server; set data.public_fraction > 0 to fit on a public pool)")
    if len(pool) > n:
        pool = np.sort(np.random.default_rng(np.random.SeedSequence([seed, 0xF17])).choice(pool, n, replace=False))
    return pool, f"{len(pool)} images from {source}"


def input_size(run, requested: ImageSize, paper: Optional[int]) -> Optional[int]:
    """Pixels per side of the images the VAE encodes (``paper``: the paper's size, None = the data's own);
    None while the pipeline's configs cannot be read without a download (the model's loading then says why)."""
    facts = pipeline_facts(run.guidance)
    if facts is None:
        return None
    data = data_image_size(run)
    return facts.resolve_image_size(requested, data if paper is None else paper, data, "method.image_size")


def loaded_input_size(run, requested: ImageSize, paper: Optional[int]) -> int:
    """``input_size`` once the guidance model is loaded (its configs are then on disk)."""
    size = input_size(run, requested, paper)
    if size is None:
        raise ConfigError(f"the configs of guidance model '{run.guidance.model}' cannot be read to size its "
                          "inputs; pass a local folder of the pipeline as guidance.model")
    return size


def input_size_note(requested: ImageSize, size: int, model) -> dict:
    """What the guidance record says about the input size."""
    return {"requested": requested, "pixels": size, "latents": size // model.vae_scale,
            "pipeline_pixels": model.image_size}


# ---- UNet passes --------------------------------------------------------------------------------------
@torch.no_grad()
def prompt_maps(feats: DiffusionFeatures, images: torch.Tensor, indices: np.ndarray, tokens: torch.Tensor,
                prompt_ids: torch.Tensor, condition: Optional[torch.Tensor] = None) -> dict[str, torch.Tensor]:
    """Activations of ``feats.spec.layers`` for every (image, prompt) pair, image-major: [B * P, C, H, W].

    ``tokens`` [Q, L, H] are the contexts of Q prompts, ``prompt_ids`` [B, P] picks P of them per image;
    ``condition`` [B, c] (FedDifRC's h(x_i)) is injected per ``feats.spec.condition_mode``.
    """
    from fedguide.guidance.hooks import unet_features

    model, spec = feats.model, feats.spec
    prompt_ids = torch.as_tensor(prompt_ids, dtype=torch.long)
    if prompt_ids.ndim != 2 or prompt_ids.shape[0] != len(images) or len(indices) != len(images):
        raise ValueError(f"{len(images)} images, {len(indices)} indices and prompt ids {tuple(prompt_ids.shape)}: "
                         "one row of prompt ids and one index per image")
    per_image = prompt_ids.shape[1]
    latents = model.encode_image(images, size=spec.image_size)
    if spec.t > 0:
        noise = sample_noise(indices, latents.shape[1:], spec.noise_seed).to(latents.device, latents.dtype)
        latents, _ = model.add_noise(latents, spec.t, noise=noise)
    latents = latents.repeat_interleave(per_image, 0)
    context = tokens[prompt_ids.reshape(-1).to(tokens.device)]
    if condition is not None:
        condition = condition.repeat_interleave(per_image, 0)
    context = inject(context, condition, spec.condition_mode, feats.condition_map)
    context, class_labels = model.condition_inputs(context)
    return unet_features(model, latents, spec.t, context, spec.layers, class_labels=class_labels)


@torch.no_grad()
def prompt_vectors(feats: DiffusionFeatures, images: torch.Tensor, indices: np.ndarray, tokens: torch.Tensor,
                   prompt_ids: torch.Tensor, condition: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Fused vectors [B, P, d] (float32, CPU) of every (image, prompt) pair."""
    prompt_ids = torch.as_tensor(prompt_ids, dtype=torch.long)
    maps = prompt_maps(feats, images, indices, tokens, prompt_ids, condition)
    return feats.recipe(maps).float().cpu().reshape(len(images), prompt_ids.shape[1], -1)


def block_channels(unet, layer: str) -> Optional[int]:
    """Output channels of a UNet block named as in hooks.py, read from its modules (no forward pass);
    None when the name or the block's layout is not one this reads (the fit then reports any mismatch)."""
    name = layer.removesuffix(".pre")
    try:
        if name == "mid":
            block = unet.mid_block
        else:
            kind, i = name.split(".")
            block = (unet.down_blocks if kind == "down" else unet.up_blocks)[int(i)]
        return int(block.resnets[-1].out_channels)
    except (AttributeError, IndexError, ValueError, TypeError):
        return None


# ---- fitted bases and cached arrays --------------------------------------------------------------------
def _json_digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]


def fit_basis(feats: DiffusionFeatures, name: str, run, store: FeatureStore, fit_desc: dict,
              batches: Callable[[], Iterable[dict[str, torch.Tensor]]], total: int, rebuild: bool,
              show_progress: bool = True) -> bool:
    """Gives ``feats`` its fitted recipe (see the module docstring); True when it was fitted here."""
    recipe = feats.recipe
    run_copy = Path(run.run_dir) / "guidance" / f"{name}.safetensors"
    key = {"model": feats.model.model_id, "spec": feats.spec.as_dict(), "recipe": recipe.recipe(), "fit": fit_desc}
    cache_copy = store.root / "bases" / f"{name}-{_json_digest(key)}.safetensors"
    for path in () if rebuild else (run_copy, cache_copy):
        if path.is_file():
            loaded = type(recipe).load(path)
            if loaded.recipe() != recipe.recipe():
                raise ConfigError(f"{path} holds a basis for {loaded.recipe()}, this run asks for {recipe.recipe()}; "
                                  "delete it or rerun with --rebuild")
            feats.recipe = loaded
            if path != run_copy:
                loaded.save(run_copy)
            return False

    def counted():
        with progress(total, f"fitting the {name} PCA basis", enabled=show_progress) as advance:
            for maps in batches():
                yield maps
                advance(next(iter(maps.values())).shape[0])

    recipe.fit(counted())
    cache_copy.parent.mkdir(parents=True, exist_ok=True)
    recipe.save(cache_copy)
    recipe.save(run_copy)
    return True


def data_recipe(data_settings) -> dict:
    """The data section as a feature-cache key sees it: without where the tensors sit during training
    (data.on_device), which changes no image."""
    raw = data_settings.model_dump(mode="json")
    raw.pop("on_device", None)
    return raw


def feature_key(feats: DiffusionFeatures, run, rows: np.ndarray, **extra) -> FeatureKey:
    data = run.data_settings
    return feats.key(data.name, "train", data.fraction, seed=feats.spec.noise_seed,
                     data=data_recipe(data), samples=digest(rows), num_samples=int(len(rows)), **extra)


def cached_features(store: FeatureStore, key: FeatureKey, rows: np.ndarray,
                    compute_rows: Callable[[np.ndarray], torch.Tensor], batch_size: int, rebuild: bool,
                    description: str, show_progress: bool = True) -> np.ndarray:
    """[len(rows), ...] features of the samples ``rows`` (global indices), computed once, memory-mapped."""
    return store.get_or_compute(key, len(rows), lambda pos: compute_rows(rows[pos]), batch_size=batch_size,
                                rebuild=rebuild, description=description, progress=show_progress)


def in_batches(indices: np.ndarray, batch_size: int) -> Iterable[np.ndarray]:
    for start in range(0, len(indices), batch_size):
        yield indices[start: start + batch_size]


# ---- what setup did ----------------------------------------------------------------------------------
class GuidanceRecord:
    """``<run dir>/guidance/<method>.json``; only the first process to set the method up writes it."""

    def __init__(self, run, method: str):
        self.run = run
        self.path = Path(run.run_dir) / "guidance" / f"{method}.json"
        self.first = not self.path.is_file()  # worker processes and resumed runs find it written
        self.data: dict[str, Any] = {"method": method}
        self._t0 = time.perf_counter()

    def note(self, key: str, value: Any, message: Optional[str] = None, warn: bool = False) -> None:
        self.data[key] = value
        if message and self.first:
            (log.warning if warn else log.info)(message)

    def write(self) -> None:
        if self.first:
            source = source_record(self.run.guidance, self.run)  # the oracle's network, pool and accuracies
            if source is not None:
                self.data["guidance_source"] = source
            self.data["setup_seconds"] = round(time.perf_counter() - self._t0, 3)
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_json(self.path, self.data)


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0
