"""Fashion-MNIST from its IDX files (gzipped or not), with the official download as a last resort."""
from __future__ import annotations

import gzip
import zlib
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from fedguide.data.sources.base import (DATASETS, DatasetSplits, SourceParams, candidate_roots, download_dir,
                                        download_file, normalise, offline)
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


def _find(folder: Path, stem: str) -> Optional[Path]:
    for name in (stem, stem + ".gz"):
        if (folder / name).is_file():
            return folder / name
    return None


def locate(root: Optional[str]) -> Optional[dict[str, Path]]:
    for base in candidate_roots(root, "FEDGUIDE_DATA", SYSTEM_DIR):
        for sub in LAYOUTS:
            folder = base / sub
            found = {k: _find(folder, stem) for k, stem in FILES.items()}
            if all(found.values()):
                return found  # type: ignore[return-value]
    return None


def download(target: Path, timeout: float = 10.0) -> dict[str, Path]:
    out = {}
    for key, stem in FILES.items():
        dest = target / f"{stem}.gz"
        if not dest.is_file():
            download_file(URL + stem + ".gz", dest, timeout)
        out[key] = dest
    return out


def default_download_dir() -> Path:
    return download_dir("fashion-mnist")


@DATASETS.register("fmnist", params=SourceParams, summary="Fashion-MNIST (IDX files), 10 classes, 28x28 grey")
def load_fmnist(params: SourceParams) -> DatasetSplits:
    found = locate(params.root)
    if found is None:
        target = default_download_dir()
        try:
            if offline():  # checked before any download is attempted
                raise OSError("downloads disabled by FEDGUIDE_OFFLINE=1")
            found = download(target)
        except OSError as err:
            looked = ", ".join(str(p) for p in candidate_roots(params.root, "FEDGUIDE_DATA", SYSTEM_DIR))
            raise ConfigError(
                f"Fashion-MNIST not found (looked in {looked}) and the download from {URL} failed ({err}). "
                f"Fix: install the Debian package 'dataset-fashion-mnist' (files in {SYSTEM_DIR}), or set "
                "FEDGUIDE_DATA / data.root to a folder holding train-images-idx3-ubyte[.gz], "
                "train-labels-idx1-ubyte[.gz], t10k-images-idx3-ubyte[.gz], t10k-labels-idx1-ubyte[.gz]."
            ) from None
    arrays = {k: read_idx(p) for k, p in found.items()}
    for split in ("train", "test"):
        if len(arrays[f"{split}_x"]) != len(arrays[f"{split}_y"]):
            raise ConfigError(f"Fashion-MNIST {split} images and labels differ in length; re-download them")
    return DatasetSplits(
        train_x=normalise(torch.from_numpy(arrays["train_x"].copy()), MEAN, STD),
        train_y=torch.from_numpy(arrays["train_y"].astype(np.int64)),
        test_x=normalise(torch.from_numpy(arrays["test_x"].copy()), MEAN, STD),
        test_y=torch.from_numpy(arrays["test_y"].astype(np.int64)),
        class_names=list(CLASS_NAMES),
    )
