"""Shared machinery of the image-file sources: one sample record, decoding, the seeded split, the tensors.

Decisions, where the datasets leave a choice open:

- Every image is decoded to RGB (grey and palette images are expanded) and resized to a square
  ``image_size`` x ``image_size`` without keeping the aspect ratio, as the FL papers' loaders do
  (``Resize((s, s))``): nothing of the object is cropped away. Bilinear, antialiased resampling; JPEGs
  are decoded at a reduced scale first when that still leaves at least ``image_size`` pixels (PIL's
  draft mode), which makes large folders several times faster to read and changes nothing visible at
  the small sizes held in memory.
- Pixels are standardised per channel once at load (ImageNet mean/std unless configured), so batches
  are plain gathers like every other source.
- Names sort case-insensitively (ties broken by the exact name): deterministic on every file system, and
  the same order as DomainNet's official label numbering (``The_Eiffel_Tower`` between ``tent`` and
  ``tiger``).
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
from typing import Callable, Iterable, Optional

import numpy as np
import torch
from pydantic import Field, field_validator

from fedguide.data.sources.base import DatasetSplits, SourceParams, candidate_roots, download_dir
from fedguide.registry import ConfigError

IMAGE_SUFFIXES = frozenset({".jpg", ".jpeg", ".png", ".bmp"})
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


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


def find_root(root: Optional[str], dataset: str, subdirs: tuple[str, ...],
              looks_right: Callable[[Path], bool]) -> tuple[Optional[Path], list[Path]]:
    """The first folder that ``looks_right``: data.root, $FEDGUIDE_DATA, then the download folder, each
    as it is or with one of ``subdirs`` appended. Also returns every folder looked at, for the error."""
    bases = candidate_roots(root, "FEDGUIDE_DATA") + [download_dir(dataset)]
    looked = []
    for base in bases:
        for sub in ("",) + subdirs:
            folder = base / sub if sub else base
            if folder in looked:
                continue
            looked.append(folder)
            if folder.is_dir() and looks_right(folder):
                return folder, looked
    return None, looked


def decode_image(path: Path, size: int, layout: str) -> np.ndarray:
    """uint8 [3, size, size]; an unreadable file is a ConfigError naming it and the expected layout."""
    from PIL import Image

    try:
        with Image.open(path) as img:
            img.draft("RGB", (size, size))
            rgb = img.convert("RGB").resize((size, size), Image.Resampling.BILINEAR)
    except (OSError, ValueError, SyntaxError, EOFError, Image.DecompressionBombError) as err:
        raise ConfigError(f"cannot read image {path} ({err}); replace or delete the file. "
                          f"Expected layout: {layout}") from None
    return np.asarray(rgb, dtype=np.uint8).transpose(2, 0, 1)


def images_tensor(paths: list[Path], params: ImageParams, layout: str) -> torch.Tensor:
    """Decoded, resized and standardised float32 [N, 3, S, S]."""
    size = params.image_size
    raw = np.empty((len(paths), 3, size, size), dtype=np.uint8)
    for i, path in enumerate(paths):
        raw[i] = decode_image(path, size, layout)
    x = torch.from_numpy(raw).to(torch.float32).div_(255.0)
    mean = torch.tensor(params.mean, dtype=torch.float32).view(1, 3, 1, 1)
    std = torch.tensor(params.std, dtype=torch.float32).view(1, 3, 1, 1)
    return x.sub_(mean).div_(std).contiguous()


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
                         domain_names=list(domain_names) if domain_names is not None else None, **out)
