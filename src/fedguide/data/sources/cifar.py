"""CIFAR-10 and CIFAR-100 from the official "python version" pickles, with the official download.

Layouts: ``cifar-10-batches-py/{data_batch_1..5, test_batch, batches.meta}`` and
``cifar-100-python/{train, test, meta}``, found under data.root or $FEDGUIDE_DATA directly, in a
``cifar10``/``cifar100`` (or ``CIFAR10``/``CIFAR100``) sub-folder, or with the root being that folder.
Each batch is a pickled dict: ``data`` uint8 [N, 3072] (1024 red, then green, then blue values, row-major
32x32) and ``labels`` (CIFAR-100: ``fine_labels`` and ``coarse_labels``).

Decisions:
- Class names come from the meta file, in label order, so they always match the files.
- Normalisation uses the per-channel mean and standard deviation of the training pixels:
  CIFAR-10 mean (0.4914, 0.4822, 0.4465), std (0.2470, 0.2435, 0.2616); CIFAR-100 mean
  (0.5071, 0.4865, 0.4409), std (0.2673, 0.2564, 0.2762). Many repositories use CIFAR-10 std
  (0.2023, 0.1994, 0.2010), which is not the pixel std; the difference only rescales the inputs.
- CIFAR-LT is the ``longtail`` partition applied to these sources, not a separate source.
"""
from __future__ import annotations

from pathlib import Path
from typing import Literal, Optional

import numpy as np
import torch
from pydantic import Field

from fedguide.data.sources._files import (as_text, check_lengths, corrupt, fetch_archive, field, find_or_fetch,
                                          has_paths, labels_int64, load_pickle)
from fedguide.data.sources._images import RawImages, to_splits
from fedguide.data.sources.base import DATASETS, DatasetSplits, SourceParams

URL_10 = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
URL_100 = "https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz"
FOLDER_10, FOLDER_100 = "cifar-10-batches-py", "cifar-100-python"
TRAIN_10 = tuple(f"data_batch_{i}" for i in range(1, 6))
LAYOUT_10 = f"{FOLDER_10}/{{data_batch_1..5, test_batch, batches.meta}} (unpacked cifar-10-python.tar.gz)"
LAYOUT_100 = f"{FOLDER_100}/{{train, test, meta}} (unpacked cifar-100-python.tar.gz)"
SUBFOLDERS_10 = (FOLDER_10, f"cifar10/{FOLDER_10}", f"CIFAR10/{FOLDER_10}", "")
SUBFOLDERS_100 = (FOLDER_100, f"cifar100/{FOLDER_100}", f"CIFAR100/{FOLDER_100}", "")
MEAN_10, STD_10 = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
MEAN_100, STD_100 = (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)


class Cifar100Params(SourceParams):
    label: Literal["fine", "coarse"] = Field(
        "fine", description="fine: the 100 classes; coarse: the 20 superclasses")


def read_batch(path: Path, label_key: str, num_classes: int, title: str, layout: str):
    record = load_pickle(path, title, layout)
    data = np.asarray(field(record, "data", path, title, layout))
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3 * 32 * 32:
        raise corrupt(path, title, layout, f"'data' is {data.dtype} {data.shape}, expected uint8 [N, 3072]")
    images = torch.from_numpy(data.reshape(-1, 3, 32, 32).copy())
    labels = labels_int64(field(record, label_key, path, title, layout), num_classes, path, title, layout)
    check_lengths(images, labels, path, title, layout)
    return images, labels


def read_names(path: Path, key: str, title: str, layout: str) -> list[str]:
    return [as_text(n) for n in field(load_pickle(path, title, layout), key, path, title, layout)]


def read_cifar10(root: Optional[str]) -> RawImages:
    title = "CIFAR-10"
    folder = find_or_fetch(title, root, "cifar10", SUBFOLDERS_10, has_paths((*TRAIN_10, "test_batch", "batches.meta")),
                           LAYOUT_10, URL_10, fetch_archive(URL_10, "cifar-10-python.tar.gz"))
    names = read_names(folder / "batches.meta", "label_names", title, LAYOUT_10)
    train = [read_batch(folder / b, "labels", len(names), title, LAYOUT_10) for b in TRAIN_10]
    test_x, test_y = read_batch(folder / "test_batch", "labels", len(names), title, LAYOUT_10)
    return RawImages(torch.cat([x for x, _ in train]), torch.cat([y for _, y in train]), test_x, test_y, names)


def read_cifar100(root: Optional[str], label: str = "fine") -> RawImages:
    title = "CIFAR-100"
    folder = find_or_fetch(title, root, "cifar100", SUBFOLDERS_100, has_paths(("train", "test", "meta")),
                           LAYOUT_100, URL_100, fetch_archive(URL_100, "cifar-100-python.tar.gz"))
    names = read_names(folder / "meta", f"{label}_label_names", title, LAYOUT_100)
    train_x, train_y = read_batch(folder / "train", f"{label}_labels", len(names), title, LAYOUT_100)
    test_x, test_y = read_batch(folder / "test", f"{label}_labels", len(names), title, LAYOUT_100)
    return RawImages(train_x, train_y, test_x, test_y, names)


@DATASETS.register("cifar10", params=SourceParams, summary="CIFAR-10 (python pickles), 10 classes, 32x32 RGB")
def load_cifar10(params: SourceParams) -> DatasetSplits:
    return to_splits(read_cifar10(params.root), MEAN_10, STD_10)


@DATASETS.register("cifar100", params=Cifar100Params,
                   summary="CIFAR-100 (python pickles), 100 fine or 20 coarse classes, 32x32 RGB")
def load_cifar100(params: Cifar100Params) -> DatasetSplits:
    return to_splits(read_cifar100(params.root, params.label), MEAN_100, STD_100)
