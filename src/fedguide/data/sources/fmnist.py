"""Fashion-MNIST from its IDX files (gzipped or not), with the official download as a last resort.

Layouts: the four files directly in data.root, $FEDGUIDE_DATA, the Debian package's folder or the download
folder, or in a ``fashion-mnist``, ``fmnist``, ``FashionMNIST/raw`` or ``FashionMNIST`` sub-folder.
The IDX reader and the four-file probe serve MNIST too, whose files have the same names.
"""
from __future__ import annotations

import gzip
import zlib
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from fedguide.data.sources._files import fetch_files, find_or_fetch, labels_int64
from fedguide.data.sources._images import normalise
from fedguide.data.sources.base import DATASETS, DatasetSplits, SourceParams
from fedguide.registry import ConfigError

FILES = {
    "train_x": "train-images-idx3-ubyte",
    "train_y": "train-labels-idx1-ubyte",
    "test_x": "t10k-images-idx3-ubyte",
    "test_y": "t10k-labels-idx1-ubyte",
}
URL = "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/"
SYSTEM_DIR = "/usr/share/datasets/fashion-mnist"
CLASS_NAMES = ["T-shirt/top", "trouser", "pullover", "dress", "coat",
               "sandal", "shirt", "sneaker", "bag", "ankle boot"]
MEAN, STD = 0.2860, 0.3530
# Sub-folders under a root that common tools use for these files.
LAYOUTS = ("", "fashion-mnist", "fmnist", "FashionMNIST/raw", "FashionMNIST")
LAYOUT = ("train-images-idx3-ubyte[.gz], train-labels-idx1-ubyte[.gz], t10k-images-idx3-ubyte[.gz], "
          "t10k-labels-idx1-ubyte[.gz]")


def read_idx(path: Path) -> np.ndarray:
    """Parse an IDX file (the format's header: 2 zero bytes, a type code, the rank, then big-endian dims)."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as fh:
            data = fh.read()
    except (EOFError, OSError, zlib.error) as err:
        raise ConfigError(f"{path} is corrupt or truncated ({err}); re-download it") from None
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] != 0x08:
        raise ConfigError(f"{path} is not an unsigned-byte IDX file; re-download it or fix data.root")
    rank = data[3]
    if len(data) < 4 + 4 * rank:
        raise ConfigError(f"{path} is truncated inside its header; re-download it")
    dims = [int.from_bytes(data[4 + 4 * i: 8 + 4 * i], "big") for i in range(rank)]
    body = np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * rank)
    if body.size != int(np.prod(dims)):
        raise ConfigError(f"{path} has {body.size} values where its header promises {int(np.prod(dims))}; "
                          "re-download it")
    return body.reshape(dims)


def idx_files(folder: Path) -> Optional[dict[str, Path]]:
    """The four IDX files in ``folder`` (each plain or .gz, plain preferred), or None when one is missing."""
    found = {}
    for key, stem in FILES.items():
        hits = [folder / n for n in (stem, stem + ".gz") if (folder / n).is_file()]
        if not hits:
            return None
        found[key] = hits[0]
    return found


@DATASETS.register("fmnist", params=SourceParams, summary="Fashion-MNIST (IDX files), 10 classes, 28x28 grey")
def load_fmnist(params: SourceParams) -> DatasetSplits:
    found = find_or_fetch(
        "Fashion-MNIST", params.root, "fashion-mnist", LAYOUTS, idx_files, LAYOUT, URL,
        fetch_files({f"{stem}.gz": f"{URL}{stem}.gz" for stem in FILES.values()}),
        how=f"The Debian package 'dataset-fashion-mnist' installs it in {SYSTEM_DIR}.", system_dirs=(SYSTEM_DIR,))
    arrays = {k: read_idx(p) for k, p in found.items()}
    labels = {}
    for split in ("train", "test"):
        if len(arrays[f"{split}_x"]) != len(arrays[f"{split}_y"]):
            raise ConfigError(f"Fashion-MNIST {split} images and labels differ in length; re-download them")
        path = found[f"{split}_y"]  # a label outside 0..9 would be dropped by the partition, then crash training
        labels[split] = labels_int64(arrays[f"{split}_y"], len(CLASS_NAMES), path, "Fashion-MNIST", LAYOUT)
    return DatasetSplits(
        train_x=normalise(torch.from_numpy(arrays["train_x"].copy()), MEAN, STD),
        train_y=labels["train"],
        test_x=normalise(torch.from_numpy(arrays["test_x"].copy()), MEAN, STD),
        test_y=labels["test"],
        class_names=list(CLASS_NAMES),
        pixel_stats=(MEAN, STD),
    )
