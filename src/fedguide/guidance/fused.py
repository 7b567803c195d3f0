"""UNet feature maps to one vector per image: the two fusion recipes of the diffusion-guided methods.

The input is a dict ``{layer name: [B, C_l, H_l, W_l] tensor}`` holding the activations of chosen
UNet blocks (``"down.3"``, ``"mid"``, ``"up.1"``, ...); the output is a ``[B, d]`` tensor.

This file holds
- ``PCABasis``: one PCA, fitted with scikit-learn and applied with a plain torch matmul, so that
  applying it works batched on any device and dtype without scikit-learn;
- ``layer_dims``: how d is split over the layers; ``spatial_pool``: mean or RMS over positions;
- ``FusedFeatures``: the FedDifRC recipe (Eq. 8). For each chosen layer l, a channel PCA
  P_l: R^{C_l} -> R^{c_l} is applied to the channel vector at every spatial position, the reduced map
  is pooled over positions, and the layers are concatenated: z = [pool(P_l(F_l)) for l] in R^d with
  d = sum c_l. For SD-1.5's decoder layers that is 1280->256, 640->128, 320->128 (d/2, d/4, d/4, d=512);
- ``PooledPCAFeatures``: the SemanticFL recipe (Eqs. 1-3): global average pooling of each chosen
  encoder, mid and decoder block's map (Eq. 1), concatenation in the given layer order (Eq. 2), and
  one PCA of the concatenated vector down to d (Eq. 3).

Decisions
- Fit once, reuse. The PCA bases are fitted once on a sample of images (server side), saved, shared
  and never refitted; a second ``fit`` raises. The released FedDifRC code refits the PCA on every
  batch, so every batch gets its own mean, axes and signs: the same image gets different features
  depending on its batch mates, and features of different batches (or clients) live in different
  coordinate systems, which makes prototypes and distances across them meaningless.
- Solver: exact. ``covariance_eigh`` when there are at least as many samples as features (the usual
  case: many positions, at most a few thousand channels; scikit-learn >= 1.5), else ``full``. The
  randomized solver is approximate and the fit is a one-off cost. ``random_state`` is the seed all the
  same. Signs follow scikit-learn's convention, so a basis gives the same numbers as
  ``sklearn.decomposition.PCA(...).transform``.
- Bases are kept in float64 on the CPU; ``transform`` casts them to the input's dtype and device.
- Fit sample (FusedFeatures): at most ``samples_per_image`` positions per image and layer, drawn
  without replacement from a numpy generator seeded with (seed, layer index). Each layer has its own
  stream, consumed image by image, so the sample, hence the basis, does not depend on how the images
  were batched.
- ``pool="l2"`` is the root mean square over positions (per-channel L2 norm / sqrt(H*W)), so its
  scale does not depend on the map size; it is taken after the PCA, as in Eq. 8. Mean pooling
  commutes with the (affine) PCA, so for ``pool="mean"`` the PCA is applied to the pooled vector,
  which gives the same numbers H*W times cheaper.
- Default split of d: halving (d/2, d/4, ...), the last layer takes the remainder so the sum is d.
- Maps may hold more layers than chosen (a UNet hook may capture more); the extra ones are ignored.
  Layers are concatenated in the order given to the constructor, never in dict order.
- Errors: ``ConfigError`` for data and configuration problems (missing layer, wrong channel count,
  d larger than a PCA can give, unreadable file); ``RuntimeError`` for misuse of the fit-once
  lifecycle (using before ``fit``, fitting twice). ``load_state_dict``/``load`` are explicit and may
  replace the bases of a fitted object.
"""
from __future__ import annotations

import json
import math
import operator
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from fedguide.core.sealed import TENSORS_DIGEST, Unverified, load_sealed, save_sealed
from fedguide.registry import ConfigError

POOLS = ("mean", "l2")
_BASIS_FIELDS = ("mean", "components", "explained_variance_ratio")


def _positive_int(value: Any, name: str) -> int:
    try:
        if isinstance(value, bool):
            raise TypeError
        number = operator.index(value)
    except TypeError:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}") from None
    if number < 1:
        raise ConfigError(f"{name} must be a positive integer, got {number}")
    return number


def _seed(value: Any) -> int:
    try:
        if isinstance(value, bool):
            raise TypeError
        seed = operator.index(value)
    except TypeError:
        raise ConfigError(f"seed must be a non-negative integer, got {value!r}") from None
    if not 0 <= seed < 2**32:  # the range numpy and scikit-learn accept
        raise ConfigError(f"seed must be in [0, 2**32), got {seed}")
    return seed


def _as_float64_matrix(samples: torch.Tensor | np.ndarray) -> np.ndarray:
    if torch.is_tensor(samples):
        samples = samples.detach().to("cpu", torch.float64).numpy()
    data = np.asarray(samples, dtype=np.float64)
    if data.ndim != 2:
        raise ConfigError(f"PCA samples must be a [N, C] matrix, got shape {data.shape}")
    if not np.isfinite(data).all():
        raise ConfigError("PCA samples hold NaN or inf; check the feature extraction (e.g. fp16 overflow)")
    return data


def _svd_solver(num_samples: int, num_features: int) -> str:
    import sklearn

    major, minor = (int(part) for part in sklearn.__version__.split(".")[:2])
    has_covariance_eigh = (major, minor) >= (1, 5)
    return "covariance_eigh" if has_covariance_eigh and num_samples >= num_features else "full"


@dataclass(eq=False)
class PCABasis:
    """One fitted PCA: ``x -> (x - mean) @ components.T``."""

    mean: torch.Tensor  # [C]
    components: torch.Tensor  # [c, C]
    explained_variance_ratio: torch.Tensor  # [c]

    def __post_init__(self) -> None:
        self.mean = torch.as_tensor(self.mean).detach().to("cpu", torch.float64)
        self.components = torch.as_tensor(self.components).detach().to("cpu", torch.float64)
        self.explained_variance_ratio = torch.as_tensor(self.explained_variance_ratio).detach().to("cpu", torch.float64)
        consistent = (self.mean.ndim == 1 and self.components.ndim == 2
                      and self.components.shape[1] == self.mean.shape[0]
                      and tuple(self.explained_variance_ratio.shape) == (self.components.shape[0],))
        if not consistent:
            raise ConfigError(
                f"inconsistent PCA basis: mean {tuple(self.mean.shape)}, components {tuple(self.components.shape)}, "
                f"explained_variance_ratio {tuple(self.explained_variance_ratio.shape)}; expected [C], [c, C], [c]")

    @property
    def in_dim(self) -> int:
        return int(self.components.shape[1])

    @property
    def out_dim(self) -> int:
        return int(self.components.shape[0])

    @classmethod
    def fit(cls, samples: torch.Tensor | np.ndarray, dim: int, seed: int = 0) -> PCABasis:
        """PCA of ``samples`` [N, C] down to ``dim`` components."""
        dim, seed = _positive_int(dim, "PCA dim"), _seed(seed)
        data = _as_float64_matrix(samples)
        num_samples, num_features = data.shape
        if num_samples < 2:
            raise ConfigError(f"PCA needs at least 2 samples, got {num_samples}; fit on more samples")
        if dim > min(num_samples, num_features):
            raise ConfigError(
                f"PCA to {dim} components needs at least {dim} samples and {dim} features, got {num_samples} samples "
                f"of {num_features} features; lower dim to at most {min(num_samples, num_features)} or fit on more samples")
        from sklearn.decomposition import PCA

        pca = PCA(n_components=dim, svd_solver=_svd_solver(num_samples, num_features), random_state=seed).fit(data)
        return cls(torch.from_numpy(pca.mean_.copy()), torch.from_numpy(pca.components_.copy()),
                   torch.from_numpy(pca.explained_variance_ratio_.copy()))

    def transform(self, x: torch.Tensor) -> torch.Tensor:
        """[..., C] -> [..., c], in x's dtype and on x's device."""
        if not torch.is_tensor(x) or not x.is_floating_point() or x.ndim < 1:
            raise ConfigError(f"PCA transform expects a floating-point tensor [..., {self.in_dim}], got "
                              f"{getattr(x, 'dtype', type(x).__name__)} {tuple(getattr(x, 'shape', ()))}")
        if x.shape[-1] != self.in_dim:
            raise ConfigError(f"PCA basis expects {self.in_dim} features in the last dimension, got shape {tuple(x.shape)}")
        mean = self.mean.to(device=x.device, dtype=x.dtype)
        components = self.components.to(device=x.device, dtype=x.dtype)
        return (x - mean) @ components.T


def layer_dims(d: int, num_layers: int, dims: Sequence[int] | None = None) -> list[int]:
    """Per-layer PCA dims summing to d: ``dims`` checked, or the halving split d/2, d/4, ..., remainder."""
    d = _positive_int(d, "d")
    num_layers = _positive_int(num_layers, "number of layers")
    if dims is not None:
        given = [_positive_int(dim, "each entry of dims") for dim in dims]
        if len(given) != num_layers:
            raise ConfigError(f"dims {given} has {len(given)} entries for {num_layers} layers; give one per layer")
        if sum(given) != d:
            raise ConfigError(f"dims {given} sum to {sum(given)}, not d={d}; make them sum to d or leave dims out")
        return given
    head = [d >> (i + 1) for i in range(num_layers - 1)]
    split = head + [d - sum(head)]
    if min(split) < 1:
        raise ConfigError(f"d={d} is too small to split over {num_layers} layers by halving ({split}); raise d or give dims")
    return split


def spatial_pool(maps: torch.Tensor, how: Literal["mean", "l2"]) -> torch.Tensor:
    """[B, C, H, W] -> [B, C]: the mean, or the root mean square ("l2"), over the H*W positions."""
    if not torch.is_tensor(maps) or maps.ndim != 4:
        raise ConfigError(f"spatial_pool expects a [B, C, H, W] tensor, got shape {tuple(getattr(maps, 'shape', ()))}")
    if how == "mean":
        return maps.mean(dim=(2, 3))
    if how == "l2":
        # Half-precision squares overflow for activations above 256: accumulate in float32.
        accumulate = torch.float32 if maps.dtype in (torch.float16, torch.bfloat16) else None
        norm = torch.linalg.vector_norm(maps, dim=(2, 3), dtype=accumulate)
        return (norm / math.sqrt(maps.shape[2] * maps.shape[3])).to(maps.dtype)
    raise ConfigError(f"unknown pool '{how}'; valid choices: {', '.join(POOLS)}")


def _check_layers(layers: Sequence[str]) -> list[str]:
    if isinstance(layers, str) or not all(isinstance(layer, str) for layer in layers):
        raise ConfigError(f"layers must be a list of layer names such as ['up.1', 'up.2'], got {layers!r}")
    names = list(layers)
    if not names:
        raise ConfigError("layers is empty; choose at least one UNet layer, e.g. ['up.1', 'up.2', 'up.3']")
    if len(set(names)) != len(names):
        raise ConfigError(f"layers {names} name a layer twice; list each layer once")
    return names


class _FittedFeatures:
    """What both recipes share: layer checks, the fit-once lifecycle, state and files."""

    NAME = ""

    def __init__(self, layers: Sequence[str], d: int, seed: int):
        self.layers = _check_layers(layers)
        self.d = _positive_int(d, "d")
        self.seed = _seed(seed)
        self._bases: dict[str, PCABasis] | None = None
        self._channels: dict[str, int] | None = None

    # --- what each recipe defines
    def _basis_out_dims(self) -> dict[str, int]:
        raise NotImplementedError

    def _basis_in_dims(self, channels: dict[str, int]) -> dict[str, int]:
        raise NotImplementedError

    def _fit_bases(self, maps_batches: Iterable[Mapping[str, torch.Tensor]]) -> tuple[dict[str, PCABasis], dict[str, int]]:
        raise NotImplementedError

    def recipe(self) -> dict:
        raise NotImplementedError

    # --- lifecycle
    @property
    def fitted(self) -> bool:
        return self._bases is not None

    def _require_fitted(self, action: str) -> None:
        if not self.fitted:
            raise RuntimeError(f"{type(self).__name__} is not fitted; call fit(...) on a sample of feature maps "
                               f"or load(...) a saved basis before {action}")

    def fit(self, maps_batches: Iterable[Mapping[str, torch.Tensor]]):
        """Fit the PCA bases once on ``maps_batches`` (an iterable of {layer: [B, C, H, W]} dicts)."""
        if self.fitted:
            raise RuntimeError(f"{type(self).__name__} is already fitted; its bases are fitted once and reused. "
                               "Create a new instance (or load a saved one) to use other bases")
        if isinstance(maps_batches, Mapping):
            raise ConfigError("fit takes an iterable of {layer: [B, C, H, W]} dicts; wrap a single batch in a list")
        # Assigned together only once every basis is fitted: a failed fit leaves the object unfitted.
        self._bases, self._channels = self._fit_bases(maps_batches)
        return self

    def _read_maps(self, maps: Mapping[str, torch.Tensor], expected: dict[str, int] | None,
                   expected_from: str) -> dict[str, int]:
        """Channel count per chosen layer, after checking presence, shape and agreement with ``expected``."""
        if not isinstance(maps, Mapping):
            raise ConfigError(f"feature maps must be a dict {{layer name: [B, C, H, W] tensor}}, got {type(maps).__name__}")
        missing = [layer for layer in self.layers if layer not in maps]
        if missing:
            raise ConfigError(f"feature maps lack layer(s) {missing} (got {sorted(maps)}); "
                              f"extract the layers this recipe uses: {self.layers}")
        channels: dict[str, int] = {}
        batch_sizes = set()
        for layer in self.layers:
            m = maps[layer]
            if not torch.is_tensor(m) or m.ndim != 4 or not m.is_floating_point():
                raise ConfigError(f"layer '{layer}': expected a floating-point [B, C, H, W] tensor, got "
                                  f"{getattr(m, 'dtype', type(m).__name__)} {tuple(getattr(m, 'shape', ()))}")
            channels[layer] = int(m.shape[1])
            batch_sizes.add(int(m.shape[0]))
            if expected is not None and channels[layer] != expected[layer]:
                raise ConfigError(f"layer '{layer}' has {channels[layer]} channels but {expected_from} had "
                                  f"{expected[layer]}; give maps of the same UNet blocks")
        if len(batch_sizes) > 1:
            raise ConfigError(f"layers disagree on the batch size: {[maps[layer].shape[0] for layer in self.layers]} "
                              f"for {self.layers}; give every layer's maps for the same images")
        return channels

    def _batches_with_channels(self, maps_batches: Iterable[Mapping[str, torch.Tensor]]):
        """Yields (maps, channels) per batch, checking that the channel counts never change."""
        channels = None
        for maps in maps_batches:
            channels = self._read_maps(maps, channels, "earlier batches")
            yield maps, channels
        if channels is None:
            raise ConfigError("fit got no feature maps; pass an iterable of {layer: [B, C, H, W]} dicts "
                              "computed on a sample of images")

    # --- state and files
    def state_dict(self) -> dict[str, torch.Tensor]:
        self._require_fitted("state_dict()")
        state = {"channels": torch.tensor([self._channels[layer] for layer in self.layers], dtype=torch.int64)}
        for name, basis in self._bases.items():
            for field in _BASIS_FIELDS:
                state[f"{name}/{field}"] = getattr(basis, field).clone()
        return state

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        out_dims = self._basis_out_dims()
        expected = {"channels"} | {f"{name}/{field}" for name in out_dims for field in _BASIS_FIELDS}
        missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
        if missing or unexpected:
            raise ConfigError(f"{type(self).__name__} state does not fit layers {self.layers}: missing {missing}, "
                              f"unexpected {unexpected}; load a state saved by the same recipe")
        counts = torch.as_tensor(state["channels"])
        if tuple(counts.shape) != (len(self.layers),) or bool((counts < 1).any()):
            raise ConfigError(f"state 'channels' must hold one positive count per layer ({len(self.layers)}), "
                              f"got {counts.tolist()}")
        channels = {layer: int(count) for layer, count in zip(self.layers, counts)}
        in_dims = self._basis_in_dims(channels)
        bases = {}
        for name, out_dim in out_dims.items():
            basis = PCABasis(*(state[f"{name}/{field}"] for field in _BASIS_FIELDS))
            if (basis.out_dim, basis.in_dim) != (out_dim, in_dims[name]):
                raise ConfigError(f"basis '{name}' maps {basis.in_dim} -> {basis.out_dim} features, but this recipe "
                                  f"needs {in_dims[name]} -> {out_dim}; load a state saved by the same recipe")
            bases[name] = basis
        self._bases, self._channels = bases, channels

    def save(self, path: Path) -> None:
        """One safetensors file: the bases as tensors, the recipe as JSON metadata; written atomically."""
        self._require_fitted("save()")
        tensors = {key: value.contiguous() for key, value in self.state_dict().items()}
        save_sealed(Path(path), tensors, {"recipe": json.dumps(self.recipe())})

    @classmethod
    def load(cls, path: Path):
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"{path}: no such feature-basis file; fit the features and save() them there first")
        # Sealed (core/sealed.py): tensors and recipe verified. A basis written before the recipe was sealed
        # (the tensors' sha256 alone) still loads: its recipe is checked against the run's below.
        try:
            opened = load_sealed(path, frozenset({"recipe"}), lambda meta: set(meta) == {"recipe", TENSORS_DIGEST})
            recipe = json.loads(opened.metadata["recipe"])
            if not isinstance(recipe, dict):
                raise ValueError("recipe metadata is not a JSON object")
        except Unverified as err:
            raise ConfigError(f"{path} is not a readable feature-basis file, or not intact ({err.reason}); delete "
                              "it or rerun with --rebuild to fit it again") from None
        except (KeyError, ValueError) as err:
            raise ConfigError(f"{path} is not a readable feature-basis file ({err}); delete it or rerun with "
                              "--rebuild to fit it again") from None
        tensors = opened.tensors
        if recipe.get("name") != cls.NAME:
            raise ConfigError(f"{path} holds a '{recipe.get('name')}' basis, not '{cls.NAME}'; load it with the class "
                              "of that recipe, or delete it or rerun with --rebuild to fit this one")
        params = {key: value for key, value in recipe.items() if key != "name"}
        try:
            features = cls(**params)
            features.load_state_dict(tensors)
        except (ConfigError, TypeError) as err:
            raise ConfigError(f"{path}: {err}; delete it or rerun with --rebuild to fit it again") from None
        return features

    def __repr__(self) -> str:
        params = ", ".join(f"{key}={value!r}" for key, value in self.recipe().items() if key != "name")
        return f"{type(self).__name__}({params}, fitted={self.fitted})"


class FusedFeatures(_FittedFeatures):
    """FedDifRC fused features (Eq. 8): per-layer channel PCA, spatial pooling, concatenation to d."""

    NAME = "fused"

    def __init__(self, layers: Sequence[str], d: int = 512, dims: Sequence[int] | None = None,
                 pool: Literal["mean", "l2"] = "mean", samples_per_image: int = 64, seed: int = 0):
        super().__init__(layers, d, seed)
        self.dims = layer_dims(self.d, len(self.layers), dims)
        if pool not in POOLS:
            raise ConfigError(f"unknown pool '{pool}'; valid choices: {', '.join(POOLS)}")
        self.pool = pool
        self.samples_per_image = _positive_int(samples_per_image, "samples_per_image")

    def recipe(self) -> dict:
        return {"name": self.NAME, "layers": list(self.layers), "d": self.d, "dims": list(self.dims),
                "pool": self.pool, "samples_per_image": self.samples_per_image, "seed": self.seed}

    def _basis_out_dims(self) -> dict[str, int]:
        return dict(zip(self.layers, self.dims))

    def _basis_in_dims(self, channels: dict[str, int]) -> dict[str, int]:
        return dict(channels)

    def _fit_bases(self, maps_batches):
        streams = {layer: np.random.default_rng([self.seed, i]) for i, layer in enumerate(self.layers)}
        collected: dict[str, list[torch.Tensor]] = {layer: [] for layer in self.layers}
        channels: dict[str, int] = {}
        for maps, channels in self._batches_with_channels(maps_batches):
            for layer in self.layers:
                collected[layer].append(_sample_positions(maps[layer], self.samples_per_image, streams[layer]))
        bases = {}
        for layer, dim in zip(self.layers, self.dims):
            if channels[layer] < dim:
                raise ConfigError(f"layer '{layer}' has {channels[layer]} channels, fewer than its PCA dim {dim} "
                                  f"(dims {self.dims}); lower dims (or d) so each layer's dim is at most its channels")
            samples = torch.cat(collected[layer])
            if samples.shape[0] < max(dim, 2):
                raise ConfigError(f"layer '{layer}': PCA to {dim} dims needs at least {max(dim, 2)} sampled positions, "
                                  f"got {samples.shape[0]}; fit on more images or raise samples_per_image")
            bases[layer] = PCABasis.fit(samples, dim, self.seed)
        return bases, channels

    def __call__(self, maps: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """{layer: [B, C_l, H_l, W_l]} -> [B, d]."""
        self._require_fitted("computing features")
        self._read_maps(maps, self._channels, "the fitted basis")
        parts = []
        for layer in self.layers:
            basis, m = self._bases[layer], maps[layer]
            if self.pool == "mean":
                parts.append(basis.transform(spatial_pool(m, "mean")))
            else:
                reduced = basis.transform(m.movedim(1, -1)).movedim(-1, 1)  # PCA of each position's channels
                parts.append(spatial_pool(reduced, self.pool))
        return torch.cat(parts, dim=1)


def _sample_positions(maps: torch.Tensor, per_image: int, stream: np.random.Generator) -> torch.Tensor:
    """[B, C, H, W] -> [B * k, C]: k = min(per_image, H*W) distinct random positions' channel vectors per image."""
    batch, channels, height, width = maps.shape
    # One row of draws per image, in image order: the sample does not depend on the batching.
    order = np.argsort(stream.random((batch, height * width)), axis=1)[:, :per_image]
    index = torch.from_numpy(order).to(maps.device)
    flat = maps.detach().reshape(batch, channels, height * width)
    picked = flat.gather(2, index.unsqueeze(1).expand(batch, channels, index.shape[1]))
    keep_dtype = torch.promote_types(maps.dtype, torch.float32)
    return picked.permute(0, 2, 1).reshape(-1, channels).to("cpu", keep_dtype)


class PooledPCAFeatures(_FittedFeatures):
    """SemanticFL features (Eqs. 1-3): global average pooling per layer, concatenation, one PCA to d."""

    NAME = "pooled_pca"

    def __init__(self, layers: Sequence[str], d: int = 512, seed: int = 0):
        super().__init__(layers, d, seed)

    def recipe(self) -> dict:
        return {"name": self.NAME, "layers": list(self.layers), "d": self.d, "seed": self.seed}

    def _basis_out_dims(self) -> dict[str, int]:
        return {"concat": self.d}

    def _basis_in_dims(self, channels: dict[str, int]) -> dict[str, int]:
        return {"concat": sum(channels.values())}

    def _pooled(self, maps: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return torch.cat([spatial_pool(maps[layer], "mean") for layer in self.layers], dim=1)

    def _fit_bases(self, maps_batches):
        rows, channels = [], {}
        for maps, channels in self._batches_with_channels(maps_batches):
            rows.append(self._pooled(maps).detach().to("cpu", torch.float64))
        width = sum(channels.values())
        if width < self.d:
            raise ConfigError(f"the pooled maps of layers {self.layers} concatenate to {width} features, fewer than "
                              f"d={self.d}; lower d to at most {width} (or choose more layers)")
        samples = torch.cat(rows)
        if samples.shape[0] < max(self.d, 2):
            raise ConfigError(f"PCA to d={self.d} needs at least {max(self.d, 2)} images, got {samples.shape[0]}; "
                              "fit on more images or lower d")
        return {"concat": PCABasis.fit(samples, self.d, self.seed)}, channels

    def __call__(self, maps: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """{layer: [B, C_l, H_l, W_l]} -> [B, d]."""
        self._require_fitted("computing features")
        self._read_maps(maps, self._channels, "the fitted basis")
        return self._bases["concat"].transform(self._pooled(maps))
