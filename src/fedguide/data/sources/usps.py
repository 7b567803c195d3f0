"""USPS handwritten digits (16x16 grey) in either of its two common forms, with the LIBSVM download.

Forms, found directly in data.root or $FEDGUIDE_DATA or in a ``usps`` or ``USPS`` sub-folder:
- LIBSVM: ``usps.bz2`` and ``usps.t.bz2`` (or the same files unpacked, ``usps`` and ``usps.t``). A line is
  ``label index:value ...`` with labels 1..10 (digit = label - 1), indices 1..256 over the 16x16 pixels in
  row-major order and values in [-1, 1]; an index left out has the value 0, as LIBSVM's sparse format says.
- HDF5 (as shared on Kaggle): ``usps.h5`` with groups ``train`` and ``test``, each holding ``data``
  [N, 256] in [0, 1] and ``target`` 0..9. Reading it needs h5py.

Decisions:
- The LIBSVM form is tried first when both are present: it is the one with an official download.
- Pixels are mapped to uint8 (value in [-1, 1] -> round((v + 1) / 2 * 255); value in [0, 1] -> round(v * 255))
  so every source hands the same kind of raw images to normalisation.
- Normalisation: mean 0.2473, std 0.2665, the training pixels' statistics as used in domain-adaptation code.
"""
from __future__ import annotations

import bz2
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from fedguide.data.sources._files import check_lengths, corrupt, fetch_files, find_or_fetch, labels_int64
from fedguide.data.sources._images import RawImages, to_splits
from fedguide.data.sources.base import DATASETS, DatasetSplits, SourceParams
from fedguide.registry import ConfigError

URL = "https://www.csie.ntu.edu.tw/~cjlin/libsvmtools/datasets/multiclass/"
LIBSVM_FILES = {"train": "usps.bz2", "test": "usps.t.bz2"}
SUBFOLDERS = ("usps", "USPS", "")
LAYOUT = "usps.bz2 and usps.t.bz2 (LIBSVM, or unpacked usps and usps.t), or usps.h5 (directly, or in usps/)"
SIDE = 16
MEAN, STD = (0.2473,), (0.2665,)
CLASS_NAMES = [str(d) for d in range(10)]
TITLE = "USPS"


def _probe(folder: Path) -> Optional[dict[str, Path]]:
    for train, test in (("usps.bz2", "usps.t.bz2"), ("usps", "usps.t")):
        if (folder / train).is_file() and (folder / test).is_file():
            return {"train": folder / train, "test": folder / test}
    if (folder / "usps.h5").is_file():
        return {"h5": folder / "usps.h5"}
    return None


def to_uint8(values: np.ndarray, low: float, path: Path) -> torch.Tensor:
    """[N, 256] pixel values in [low, 1] -> uint8 [N, 1, 16, 16]."""
    values = np.asarray(values, dtype=np.float64)
    if values.ndim != 2 or values.shape[1] != SIDE * SIDE:
        raise corrupt(path, TITLE, LAYOUT, f"pixels have shape {values.shape}, expected [N, 256]")
    if values.size and (values.min() < low - 1e-6 or values.max() > 1 + 1e-6):
        raise corrupt(path, TITLE, LAYOUT, f"pixels span {values.min():.3g}..{values.max():.3g}, expected {low}..1")
    scaled = np.rint((values - low) / (1 - low) * 255).clip(0, 255).astype(np.uint8)
    return torch.from_numpy(scaled.reshape(-1, 1, SIDE, SIDE))


def read_libsvm(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    opener = bz2.open if path.suffix == ".bz2" else open
    labels, rows, line_no = [], [], 0
    try:
        with opener(path, "rt", encoding="ascii") as fh:
            for line_no, line in enumerate(fh, 1):
                tokens = line.split()
                if not tokens:
                    continue
                row = np.zeros(SIDE * SIDE)
                for token in tokens[1:]:
                    index, value = token.split(":")
                    if not 1 <= int(index) <= SIDE * SIDE:  # LIBSVM indices start at 1
                        raise ValueError(f"feature index {index} outside 1..{SIDE * SIDE}")
                    row[int(index) - 1] = float(value)
                labels.append(float(tokens[0]) - 1)
                rows.append(row)
    except (OSError, EOFError, ValueError, IndexError) as err:
        raise corrupt(path, TITLE, LAYOUT, f"line {line_no}: {type(err).__name__}: {err}") from None
    images = to_uint8(np.stack(rows) if rows else np.zeros((0, SIDE * SIDE)), -1.0, path)
    return images, labels_int64(labels, 10, path, TITLE, LAYOUT)


def read_h5(path: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    try:
        import h5py
    except ImportError:
        raise ConfigError(f"reading {path} needs h5py: pip install h5py "
                          "(or use the LIBSVM files usps.bz2 and usps.t.bz2 instead)") from None
    out = {}
    try:
        with h5py.File(path, "r") as fh:
            for split in ("train", "test"):
                group = fh[split]
                out[split] = (np.asarray(group["data"][:]), np.asarray(group["target"][:]))
    except (OSError, KeyError, TypeError, ValueError) as err:
        raise corrupt(path, TITLE, LAYOUT, f"{type(err).__name__}: {err}") from None
    splits = {}
    for split, (x, y) in out.items():
        splits[split] = (to_uint8(x, 0.0, path), labels_int64(y, 10, path, TITLE, LAYOUT))
        check_lengths(*splits[split], path, TITLE, LAYOUT)
    return splits


def read_usps(root: Optional[str]) -> RawImages:
    files = find_or_fetch(TITLE, root, "usps", SUBFOLDERS, _probe, LAYOUT, URL + LIBSVM_FILES["train"],
                          fetch_files({name: URL + name for name in LIBSVM_FILES.values()}))
    splits = read_h5(files["h5"]) if "h5" in files else {s: read_libsvm(files[s]) for s in ("train", "test")}
    return RawImages(*splits["train"], *splits["test"], list(CLASS_NAMES))


@DATASETS.register("usps", params=SourceParams, summary="USPS digits (LIBSVM .bz2 or HDF5), 10 classes, 16x16 grey")
def load_usps(params: SourceParams) -> DatasetSplits:
    return to_splits(read_usps(params.root), MEAN, STD)
