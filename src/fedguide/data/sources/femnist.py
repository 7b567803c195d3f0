"""FEMNIST as LEAF's preprocessing writes it: 62 classes of handwritten characters, each sample owned by its writer.

Files (TalwalkarLab/leaf, data/femnist): ``./preprocess.sh`` in ``leaf/data/femnist`` ends with
``data/train/*.json`` and ``data/test/*.json`` (data/utils/split_data.py lines 239-248 with ``-t sample``,
lines 53-58 with ``-t user``). Each file is ``{"users": [...], "num_samples": [...], "user_data": {writer:
{"x": [[784 floats]], "y": [ints]}}}`` (data/femnist/preprocess/data_to_json.py lines 1-5 and 80-83). An
image is the 28x28 grey thumbnail flattened row by row and divided by 255 (data_to_json.py lines 59-68), so
pixels are in [0, 1], black ink on a white page as NIST scanned it; LEAF's CNN reshapes the 784 values to
28x28 again (models/femnist/cnn.py line 20). Labels (data_to_json.py lines 25-38, ``relabel_class``):
0-9 the digits, 10-35 the upper-case letters A-Z, 36-61 the lower-case letters a-z.

Where: data.root, $FEDGUIDE_DATA or ~/.cache/fedguide/femnist, each tried as the folder holding ``train/`` and
``test/`` and as its parents ``femnist/data/``, ``leaf/data/femnist/data/``, ``data/femnist/data/``,
``femnist/``, ``data/`` (so data.root may be LEAF's ``data/femnist/data`` folder, ``data/femnist``, ``data``
or the clone's parent). Nothing is downloaded: LEAF builds the files from NIST's archive with its own
sampling, and its command (in the error when the files are missing) fixes which writers there are.

Decisions:
- Every sample's writer is its group (``DatasetSplits.train_groups``, ``test_groups``): group names are
  the writers of both splits, sorted by name, the order LEAF gives its clients (models/utils/model_utils.py
  line 45, ``sorted(data.keys())``); with ``-t user`` the test writers are groups without training samples.
  Samples are stored writer by writer in that order, each writer's in its file's order.
- A writer found in two files of one split is refused (LEAF's ``read_dir`` would keep the last one
  silently); so are pixels outside [0, 1] (a file of 0..255 integers is not what LEAF writes, and dividing
  by a guessed scale would be silent) and rows that are not 784 values.
- Normalisation: one scalar mean and std, the statistics of every training pixel of the files read (never
  of the test split), recorded in ``pixel_stats``. LEAF's own CNN takes the [0, 1] pixels as they are.
"""
from __future__ import annotations

import json
import string
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from fedguide.data.sources._files import corrupt, find_or_fetch, labels_int64
from fedguide.data.sources.base import DATASETS, DatasetSplits, SourceParams

TITLE = "FEMNIST (LEAF's JSON files)"
CLASS_NAMES = list(string.digits + string.ascii_uppercase + string.ascii_lowercase)
SIDE = 28
SUBFOLDERS = ("femnist/data", "leaf/data/femnist/data", "data/femnist/data", "femnist", "data", "")
LAYOUT = ('train/*.json and test/*.json as LEAF writes them, each {"users": [...], "num_samples": [...], '
          '"user_data": {writer: {"x": [[784 pixels in 0..1]], "y": [labels 0..61]}}}')
HOW = ("fedguide does not download it: build the files with LEAF (git clone https://github.com/TalwalkarLab/leaf; "
       "cd leaf/data/femnist; ./preprocess.sh -s niid --sf 0.05 -k 0 -t sample, a 5 % sample of the writers; "
       "--sf 1.0 for all of them; needs numpy and pillow, and downloads NIST's archive); the files land in "
       "leaf/data/femnist/data.")


def _json_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.glob("*.json") if p.is_file() and not p.name.startswith("."))


def _probe(folder: Path) -> Optional[Path]:
    return folder if _json_files(folder / "train") and _json_files(folder / "test") else None


def _writer_arrays(path: Path, writer: str, record: Any) -> tuple[np.ndarray, torch.Tensor]:
    if not isinstance(record, dict) or "x" not in record or "y" not in record:
        raise corrupt(path, TITLE, LAYOUT, f"writer {writer!r} has no 'x' and 'y' lists")
    try:
        x = np.asarray(record["x"], dtype=np.float32)
    except (TypeError, ValueError) as err:
        raise corrupt(path, TITLE, LAYOUT, f"writer {writer!r}: 'x' is not a list of pixel rows ({err})") from None
    if x.size == 0:
        x = x.reshape(0, SIDE * SIDE)
    if x.ndim != 2 or x.shape[1] != SIDE * SIDE:
        raise corrupt(path, TITLE, LAYOUT, f"writer {writer!r}: 'x' has shape {x.shape}, expected [n, 784]")
    if x.size and (not np.isfinite(x).all() or x.min() < 0.0 or x.max() > 1.0):
        raise corrupt(path, TITLE, LAYOUT, f"writer {writer!r}: pixels span {x.min():g}..{x.max():g}, expected "
                                           "0..1 (LEAF divides by 255)")
    y = labels_int64(record["y"], len(CLASS_NAMES), path, TITLE, LAYOUT)
    if len(y) != len(x):
        raise corrupt(path, TITLE, LAYOUT, f"writer {writer!r} has {len(x)} images but {len(y)} labels")
    return x, y


def read_split(folder: Path) -> dict[str, tuple[np.ndarray, torch.Tensor]]:
    """Writer -> (float32 [n, 784] pixels, int64 labels) over every JSON file of one split folder."""
    writers: dict[str, tuple[np.ndarray, torch.Tensor]] = {}
    seen_in: dict[str, Path] = {}
    for path in _json_files(folder):
        try:
            with open(path, encoding="utf-8") as fh:
                data = json.load(fh)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise corrupt(path, TITLE, LAYOUT, f"{type(err).__name__}: {err}") from None
        user_data = data.get("user_data") if isinstance(data, dict) else None
        if not isinstance(user_data, dict):
            raise corrupt(path, TITLE, LAYOUT, "no 'user_data' object")
        for writer, record in user_data.items():
            if writer in seen_in:
                raise corrupt(path, TITLE, LAYOUT, f"writer {writer!r} is also in {seen_in[writer].name}; a writer "
                                                   "belongs to one file of a split (re-run LEAF's preprocess.sh)")
            seen_in[writer] = path
            writers[writer] = _writer_arrays(path, writer, record)
    return writers


def _stack(writers: dict[str, tuple[np.ndarray, torch.Tensor]],
           index: dict[str, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    names = sorted(writers)
    pixels = np.concatenate([writers[w][0] for w in names]) if names else np.zeros((0, SIDE * SIDE), np.float32)
    labels = torch.cat([writers[w][1] for w in names]) if names else torch.zeros(0, dtype=torch.int64)
    groups = torch.cat([torch.full((len(writers[w][1]),), index[w], dtype=torch.int64) for w in names]) \
        if names else torch.zeros(0, dtype=torch.int64)
    return torch.from_numpy(pixels).reshape(-1, 1, SIDE, SIDE), labels, groups


def _pixel_stats(x: torch.Tensor, rows: int = 65536) -> tuple[float, float]:
    """Mean and (population) std of every value of ``x``, summed in float64 a block of rows at a time: a float32
    sum over hundreds of millions of pixels loses digits, and a float64 copy of all of them would double the
    memory of the largest tensor a run holds."""
    total = squares = 0.0
    for start in range(0, len(x), rows):
        block = x[start:start + rows].to(torch.float64)
        total += float(block.sum())
        squares += float(block.square().sum())
    n = x.numel()
    mean = total / n
    return mean, max(squares / n - mean * mean, 0.0) ** 0.5


def read_femnist(root: Optional[str]) -> DatasetSplits:
    folder = find_or_fetch(TITLE, root, "femnist", SUBFOLDERS, _probe, LAYOUT, how=HOW)
    train, test = read_split(folder / "train"), read_split(folder / "test")
    if not sum(len(y) for _, y in train.values()):
        raise corrupt(folder / "train", TITLE, LAYOUT, "no training samples")
    names = sorted(set(train) | set(test))
    index = {w: g for g, w in enumerate(names)}
    train_x, train_y, train_g = _stack(train, index)
    test_x, test_y, test_g = _stack(test, index)
    mean, std = _pixel_stats(train_x)
    if std == 0.0:
        raise corrupt(folder / "train", TITLE, LAYOUT, f"every training pixel is {mean:g}")
    return DatasetSplits(train_x.sub_(mean).div_(std), train_y, test_x.sub_(mean).div_(std), test_y,
                         list(CLASS_NAMES), train_groups=train_g, test_groups=test_g, group_names=names,
                         pixel_stats=(mean, std))


@DATASETS.register("femnist", params=SourceParams,
                   summary="FEMNIST (LEAF's JSON files), 62 classes, 28x28 grey, each sample's writer as its group")
def load_femnist(params: SourceParams) -> DatasetSplits:
    return read_femnist(params.root)
