"""Image pixels and image-file datasets: listing, decoding, normalising, and the seeded split into tensors.

Shared by every image source (the benchmark files, Tiny ImageNet, the digit folders, the image-folder
presets). Decisions, where the datasets leave a choice open:

- Every image file is decoded to RGB (grey and palette images are expanded). Given a size, it is resized
  to a square ``size`` x ``size`` without keeping the aspect ratio, as the FL papers' loaders do
  (``Resize((s, s))``): nothing of the object is cropped away. Bilinear, antialiased resampling. Without a
  size, images keep theirs and must all share one.
- ``draft``: JPEGs are decoded at a reduced scale first when that still leaves at least ``size`` pixels
  (PIL's draft mode). The image-folder datasets (large photos, up to hundreds of thousands of them) use it:
  it makes them several times faster to read and changes nothing visible at the small sizes held in
  memory. Tiny ImageNet's images are already 64x64, so it would gain nothing there, yet it would change
  the pixels of every image_size below 64 (up to ~30 grey levels on fine texture at 32): it stays a plain
  bilinear resize of the full image.
- Image files are recognised by suffix (.jpg, .jpeg, .png, .bmp, any case); hidden files (names starting
  with a dot, such as macOS's ``._*`` companions) are never images.
- Names sort case-insensitively (ties broken by the exact name): deterministic on every file system, and
  the same order as DomainNet's official label numbering (``The_Eiffel_Tower`` between ``tent`` and
  ``tiger``).
- Pixels are standardised once at load, with one mean and std for all channels or one per channel, so
  batches are plain gathers (the image-folder sources: ImageNet mean/std unless configured).
- Without an official split, each (domain, class) group sends round(n * test_fraction) images to the
  test side, at least one when the group has two or more and never all of them. The shuffle is seeded
  by ``split_seed`` and the group's own names, so a group's split does not change when other domains or
  classes are selected. Samples that share a ``group`` key (HAM10000's lesions) move together.
- ``max_train_per_class`` (FedCADO's 30 images per class and client) is drawn after that split, from the
  training side only, so the test images are the same with or without it. The draw is per (domain,
  class), seeded by ``split_seed`` and the group's names (salted, so it is not the split's own shuffle
  again): it is fixed independently of the run seed and of which other domains or classes are loaded.
  A group with fewer images keeps them all.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional, Sequence, Union

import numpy as np
import torch
from pydantic import Field, field_validator

from fedguide.data.sources.base import DatasetSplits, SourceParams
from fedguide.registry import ConfigError

IMAGE_SUFFIXES = frozenset({".jpg", ".jpeg", ".png", ".bmp"})
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
Stat = Union[float, Sequence[float]]  # one value for every channel, or one per channel


@dataclass
class RawImages:
    """A dataset before normalisation: uint8 [N, C, H, W] images and int64 labels."""

    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    class_names: list[str]


# ---- listing -------------------------------------------------------------------------------------

def sort_key(name: str) -> tuple[str, str]:
    return (name.casefold(), name)


def sorted_names(names: Iterable[str]) -> list[str]:
    return sorted(set(names), key=sort_key)


def subfolders(folder: Path) -> list[str]:
    """Visible sub-folder names, sorted."""
    return sorted_names(p.name for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))


def list_images(folder: Path) -> list[Path]:
    """Image files directly in ``folder`` (by suffix, any case), sorted; other files are ignored."""
    return sorted((p for p in folder.iterdir()
                   if p.is_file() and not p.name.startswith(".") and p.suffix.lower() in IMAGE_SUFFIXES),
                  key=lambda p: sort_key(p.name))


# ---- decoding ------------------------------------------------------------------------------------

def decode_image(path: Path, size: Optional[int], layout: str, draft: bool = False) -> np.ndarray:
    """uint8 [3, H, W], resized to size x size when ``size`` is given (a JPEG in draft mode first when
    ``draft``); an unreadable file is a ConfigError naming it and the expected layout."""
    from PIL import Image

    try:
        with Image.open(path) as img:
            if draft and size is not None:
                img.draft("RGB", (size, size))
            rgb = img.convert("RGB")
            if size is not None:
                rgb = rgb.resize((size, size), Image.Resampling.BILINEAR)
    except (OSError, ValueError, SyntaxError, EOFError, Image.DecompressionBombError) as err:
        raise ConfigError(f"cannot read image {path} ({err}); replace or delete the file. "
                          f"Expected layout: {layout}") from None
    return np.asarray(rgb, dtype=np.uint8).transpose(2, 0, 1)


def decode_images(paths: Sequence[Path], size: Optional[int], layout: str, draft: bool = False) -> torch.Tensor:
    """Image files as uint8 [N, 3, H, W]; without ``size`` all must share the first one's size."""
    out: Optional[np.ndarray] = None
    for i, path in enumerate(paths):
        image = decode_image(path, size, layout, draft)
        if out is None:  # filled in place, so no list of arrays is held next to the result
            out = np.empty((len(paths), *image.shape), dtype=np.uint8)
        elif image.shape != out.shape[1:]:
            raise ConfigError(f"{path} is {image.shape[2]}x{image.shape[1]} pixels while {paths[0]} is "
                              f"{out.shape[3]}x{out.shape[2]}; all images must share one size. "
                              f"Expected layout: {layout}")
        out[i] = image
    return torch.from_numpy(out if out is not None else np.zeros((0, 3, size or 1, size or 1), dtype=np.uint8))


# ---- normalising ---------------------------------------------------------------------------------

def _per_channel(value: Stat) -> torch.Tensor:
    return torch.as_tensor(value, dtype=torch.float32).view(-1, 1, 1)


def standardise_(x: torch.Tensor, mean: Stat, std: Stat) -> torch.Tensor:
    """float [N, C, H, W] in [0, 1] -> (x - mean) / std, in place."""
    return x.sub_(_per_channel(mean)).div_(_per_channel(std))


def normalise(images_uint8: torch.Tensor, mean: Stat, std: Stat) -> torch.Tensor:
    """uint8 [N, H, W] or [N, C, H, W] -> float32 [N, C, H, W], standardised once so batches are plain gathers."""
    # Contiguous uint8 first: normalising a permuted view would copy the (4x larger) float result instead.
    x = images_uint8.contiguous().to(torch.float32).div_(255.0)
    if x.dim() == 3:
        x = x.unsqueeze(1)
    return standardise_(x, mean, std)


def to_splits(raw: RawImages, mean: Stat, std: Stat) -> DatasetSplits:
    return DatasetSplits(normalise(raw.train_x, mean, std), raw.train_y,
                         normalise(raw.test_x, mean, std), raw.test_y, raw.class_names, pixel_stats=(mean, std))


# ---- image-file datasets: parameters, samples, the seeded split ----------------------------------

class ImageParams(SourceParams):
    """Keys every image-file source understands."""

    image_size: int = Field(32, ge=4, le=1024, description=(
        "side of the square images held in memory; all data is float32 in RAM, so 224 is only "
        "feasible for small datasets (DomainNet at 224 would need ~350 GB)"))
    test_fraction: float = Field(0.2, gt=0.0, lt=1.0, description=(
        "share of every (domain, class) sent to the test split when the dataset has no official split"))
    split_seed: int = Field(0, ge=0, description="fixes that split, independently of the run seed")
    max_train_per_class: Optional[int] = Field(None, ge=1, description=(
        "seeded draw (split_seed) of at most this many training images per domain and class, taken after "
        "the test split, which it leaves untouched (FedCADO: 30); null = all"))
    mean: tuple[float, float, float] = Field(IMAGENET_MEAN, description="per-channel mean subtracted at load")
    std: tuple[float, float, float] = Field(IMAGENET_STD, description="per-channel std divided by at load")

    @field_validator("std")
    @classmethod
    def _positive_std(cls, value: tuple[float, float, float]) -> tuple[float, float, float]:
        if min(value) <= 0:
            raise ValueError("every std must be positive")
        return value


@dataclass(frozen=True)
class Sample:
    """One image file and what it is: its class, its domain, and its split where the dataset fixes it."""

    path: Path
    label: str
    domain: Optional[str] = None
    split: Optional[str] = None  # "train" / "test"; None = decided by the seeded split
    group: Optional[str] = None  # samples sharing a group always land on the same side


def check_known(chosen: Optional[list[str]], known: list[str], what: str, layout: str) -> list[str]:
    """``chosen`` (validated against ``known``, order kept) or all of ``known``."""
    if chosen is None:
        return list(known)
    if not chosen:
        raise ConfigError(f"an empty list of {what} selects nothing; leave the key out to use all of them")
    unknown = [c for c in chosen if c not in known]
    if unknown:
        raise ConfigError(f"unknown {what} {unknown}; valid: {known}. Expected layout: {layout}")
    if len(set(chosen)) != len(chosen):
        raise ConfigError(f"{what} {chosen} name one entry twice")
    return list(chosen)


def group_rng(seed: int, *names: Optional[str]) -> np.random.Generator:
    """A generator of its own for one group, so a group's draw ignores which other groups are loaded."""
    return np.random.default_rng([seed, zlib.crc32("\0".join(n or "" for n in names).encode())])


def seeded_split(samples: list[Sample], test_fraction: float, seed: int) -> list[str]:
    """'train' or 'test' for every sample: fixed splits kept, the rest split per (domain, class)."""
    sides = [s.split or "" for s in samples]
    groups: dict[tuple[str, str], dict[str, list[int]]] = {}
    for i, s in enumerate(samples):
        if s.split is None:
            units = groups.setdefault((s.domain or "", s.label), {})
            units.setdefault(s.group if s.group is not None else f"#{i}", []).append(i)
    for (domain, label), units in groups.items():
        members = list(units.values())
        n = sum(len(m) for m in members)
        target = int(np.floor(n * test_fraction + 0.5))
        if n >= 2:
            target = min(max(target, 1), n - 1)
        rng = group_rng(seed, domain, label)
        order = rng.permutation(len(members))
        taken = 0
        for j in order[:-1]:  # the last unit of the shuffle always stays in train
            if taken >= target:
                break
            taken += len(members[j])
            for i in members[j]:
                sides[i] = "test"
        for m in members:
            for i in m:
                sides[i] = sides[i] or "train"
    return sides


def cap_per_class(samples: list[Sample], cap: Optional[int], seed: int) -> list[Sample]:
    """At most ``cap`` samples of every (domain, class), a seeded draw; the order of the kept ones is kept."""
    if cap is None:
        return samples
    groups: dict[tuple[str, str], list[int]] = {}
    for i, s in enumerate(samples):
        groups.setdefault((s.domain or "", s.label), []).append(i)
    keep: set[int] = set()
    for (domain, label), idx in groups.items():
        if len(idx) <= cap:
            keep.update(idx)
        else:
            rng = group_rng(seed, domain, label, "max_train_per_class")
            keep.update(rng.choice(idx, size=cap, replace=False).tolist())
    return [s for i, s in enumerate(samples) if i in keep]


def images_tensor(paths: list[Path], params: ImageParams, layout: str) -> torch.Tensor:
    """Decoded (JPEG draft mode: folders of large photos), resized and standardised float32 [N, 3, S, S]."""
    return normalise(decode_images(paths, params.image_size, layout, draft=True), params.mean, params.std)


def build_splits(samples: list[Sample], class_names: list[str], domain_names: Optional[list[str]],
                 params: ImageParams, layout: str) -> DatasetSplits:
    """Decode every sample into the train and test tensors, in the order the samples are given, after the
    seeded split and the ``max_train_per_class`` draw from the training side."""
    if not samples:
        raise ConfigError(f"no images found. Expected layout: {layout}")
    sides = seeded_split(samples, params.test_fraction, params.split_seed)
    label_id = {c: i for i, c in enumerate(class_names)}
    domain_id = {d: i for i, d in enumerate(domain_names or [])}
    parts = {}
    for side in ("train", "test"):
        chosen = [s for s, sd in zip(samples, sides) if sd == side]
        if not chosen:
            raise ConfigError(f"the {side} split is empty; add images (at least 2 per class) or adjust "
                              f"test_fraction. Expected layout: {layout}")
        parts[side] = chosen
    parts["train"] = cap_per_class(parts["train"], params.max_train_per_class, params.split_seed)
    out = {}
    for side, chosen in parts.items():
        out[f"{side}_x"] = images_tensor([s.path for s in chosen], params, layout)
        out[f"{side}_y"] = torch.tensor([label_id[s.label] for s in chosen], dtype=torch.int64)
        if domain_names is not None:
            out[f"{side}_domains"] = torch.tensor([domain_id[s.domain] for s in chosen], dtype=torch.int64)
    return DatasetSplits(class_names=list(class_names),
                         domain_names=list(domain_names) if domain_names is not None else None,
                         pixel_stats=(tuple(params.mean), tuple(params.std)), **out)
