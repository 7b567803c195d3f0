"""SVHN (cropped digits) from the official ``train_32x32.mat`` and ``test_32x32.mat``, with their download.

Layout: both files directly in data.root or $FEDGUIDE_DATA, or in a ``svhn`` or ``SVHN`` sub-folder.
Each file holds ``X`` uint8 [32, 32, 3, N] and ``y`` [N, 1] with labels 1..10, where 10 is the digit 0.

Decisions:
- Label 10 becomes 0, so label d is the digit d, as in every other digit source.
- ``extra_32x32.mat`` (531k easier images) is not read: the benchmarks train on the train split only.
- Normalisation: mean (0.4377, 0.4438, 0.4728), std (0.1980, 0.2010, 0.1970), the commonly used
  per-channel statistics of the training pixels.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import numpy as np
import torch

from fedguide.data.sources._files import check_lengths, corrupt, fetch_files, find_or_fetch, has_paths, labels_int64
from fedguide.data.sources._images import RawImages, to_splits
from fedguide.data.sources.base import DATASETS, DatasetSplits, SourceParams

URL = "http://ufldl.stanford.edu/housenumbers/"
FILES = {"train": "train_32x32.mat", "test": "test_32x32.mat"}
SUBFOLDERS = ("svhn", "SVHN", "")
LAYOUT = "train_32x32.mat and test_32x32.mat (directly, or in svhn/)"
MEAN, STD = (0.4377, 0.4438, 0.4728), (0.1980, 0.2010, 0.1970)
CLASS_NAMES = [str(d) for d in range(10)]


def read_mat(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    from scipy.io import loadmat

    title = "SVHN"
    try:
        mat = loadmat(path)
    except Exception as err:  # noqa: BLE001  (scipy fails in many ways on a damaged file; each means "re-download")
        raise corrupt(path, title, LAYOUT, f"{type(err).__name__}: {err}") from None
    if "X" not in mat or "y" not in mat:
        raise corrupt(path, title, LAYOUT, "no 'X' and 'y' variables")
    x = np.asarray(mat["X"])
    if x.dtype != np.uint8 or x.ndim != 4 or x.shape[:3] != (32, 32, 3):
        raise corrupt(path, title, LAYOUT, f"'X' is {x.dtype} {x.shape}, expected uint8 [32, 32, 3, N]")
    labels = labels_int64(mat["y"], 11, path, title, LAYOUT)
    if bool((labels == 0).any()):
        raise corrupt(path, title, LAYOUT, "label 0 found, expected 1..10 (10 is the digit 0)")
    labels = labels % 10
    images = torch.from_numpy(np.ascontiguousarray(x.transpose(3, 2, 0, 1)))  # [H, W, C, N] -> [N, C, H, W]
    check_lengths(images, labels, path, title, LAYOUT)
    return images, labels


def read_svhn(root: Optional[str]) -> RawImages:
    folder = find_or_fetch("SVHN", root, "svhn", SUBFOLDERS, has_paths(tuple(FILES.values())), LAYOUT, URL,
                           fetch_files({name: URL + name for name in FILES.values()}))
    train_x, train_y = read_mat(folder / FILES["train"])
    test_x, test_y = read_mat(folder / FILES["test"])
    return RawImages(train_x, train_y, test_x, test_y, list(CLASS_NAMES))


@DATASETS.register("svhn", params=SourceParams, summary="SVHN cropped digits (.mat files), 10 classes, 32x32 RGB")
def load_svhn(params: SourceParams) -> DatasetSplits:
    return to_splits(read_svhn(params.root), MEAN, STD)
