"""MNIST from its four IDX files (gzipped or not), with the official mirror's download as a last resort.

Layouts: the files directly in data.root or $FEDGUIDE_DATA, or in a ``mnist``, ``MNIST/raw`` (the
torchvision layout), ``MNIST`` or ``mnist/MNIST/raw`` sub-folder. Named sub-folders are tried before
the root itself, because a shared root may also hold Fashion-MNIST under the same file names.
The files have Fashion-MNIST's names and format, so its IDX reader and probe serve here too.
Normalisation: mean 0.1307, std 0.3081 (the training pixels' statistics, as commonly used).
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from fedguide.data.sources._files import check_lengths, corrupt, fetch_files, find_or_fetch, labels_int64
from fedguide.data.sources._images import RawImages, to_splits
from fedguide.data.sources.base import DATASETS, DatasetSplits, SourceParams
from fedguide.data.sources.fmnist import FILES, LAYOUT as IDX_LAYOUT, idx_files, read_idx

URL = "https://ossci-datasets.s3.amazonaws.com/mnist/"
SUBFOLDERS = ("mnist", "MNIST/raw", "MNIST", "mnist/MNIST/raw", "")
LAYOUT = IDX_LAYOUT + " (directly, or in mnist/ or MNIST/raw/)"
MEAN, STD = (0.1307,), (0.3081,)
CLASS_NAMES = [str(d) for d in range(10)]


def read_mnist(root: Optional[str]) -> RawImages:
    title = "MNIST"
    files = find_or_fetch(title, root, "mnist", SUBFOLDERS, idx_files, LAYOUT, URL,
                          fetch_files({f"{stem}.gz": f"{URL}{stem}.gz" for stem in FILES.values()}))
    out = {}
    for split in ("train", "test"):
        pixels = read_idx(files[f"{split}_x"])
        if pixels.ndim != 3:
            raise corrupt(files[f"{split}_x"], title, LAYOUT, f"{pixels.ndim}-d array, expected [N, 28, 28]")
        images = torch.from_numpy(pixels.copy()).unsqueeze(1)
        path = files[f"{split}_y"]
        labels = labels_int64(read_idx(path).astype(np.int64), 10, path, title, LAYOUT)
        check_lengths(images, labels, path, title, LAYOUT)
        out[split] = (images, labels)
    return RawImages(*out["train"], *out["test"], list(CLASS_NAMES))


@DATASETS.register("mnist", params=SourceParams, summary="MNIST (IDX files), 10 classes, 28x28 grey")
def load_mnist(params: SourceParams) -> DatasetSplits:
    return to_splits(read_mnist(params.root), MEAN, STD)
