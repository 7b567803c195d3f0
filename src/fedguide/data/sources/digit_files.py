"""SynthDigits and MNIST-M from the files federated-learning repositories distribute (no official download).

Accepted forms, in a dataset folder ``<root>/<name>/`` (names below; the root itself when so named):
1. FedBN's partitions: ``partitions/train_part0.pkl``, ``train_part1.pkl``, ... (all consecutive parts are
   read) and ``test.pkl``, each a pickled ``(images, labels)`` pair.
2. One pickle per split: ``train.pkl`` and ``test.pkl``, each a pickled ``(images, labels)`` pair.
3. One npz per split: ``train.npz`` and ``test.npz`` holding arrays ``x`` and ``y`` (or ``images`` and
   ``labels``).
4. Image folders: ``train/<digit>/*.png`` and ``test/<digit>/*.png`` (also .jpg, .bmp), ``<digit>`` in 0..9.
5. MNIST-M only, as first released: ``mnist_m_train/*.png`` with ``mnist_m_train_labels.txt`` and
   ``mnist_m_test/*.png`` with ``mnist_m_test_labels.txt`` (lines ``<file> <label>``).
Images in arrays are uint8 [N, H, W, 3] or [N, H, W]; labels are integers 0..9 ([N] or [N, 1]).

Decisions:
- Folder names: SynthDigits in ``synthdigits``, ``SynthDigits``, ``synth_digits`` or ``syn``; MNIST-M in
  ``mnistm``, ``MNIST_M``, ``mnist_m`` or ``MNIST-M``.
- Arrays must be uint8: float images may be scaled to [0, 1] or [0, 255], and guessing would be silent.
- Image files are listed and read as RGB like every image-file source (both datasets are colour; see
  ``_images``), at their own size, which all must share.
- Normalisation: mean 0.5, std 0.5 per channel, as FedBN and its followers use for every Digits domain.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from fedguide.data.sources._files import check_lengths, corrupt, find_or_fetch, labels_int64, load_pickle, read_text
from fedguide.data.sources._images import RawImages, decode_images, list_images, to_splits
from fedguide.data.sources.base import DATASETS, DatasetSplits, SourceParams

FOLDER_NAMES = {
    "synthdigits": ("synthdigits", "SynthDigits", "synth_digits", "syn"),
    "mnistm": ("mnistm", "MNIST_M", "mnist_m", "MNIST-M"),
}
TITLES = {"synthdigits": "SynthDigits", "mnistm": "MNIST-M"}
LAYOUT = ("<name>/partitions/train_part0.pkl... + <name>/test.pkl (FedBN), <name>/{train,test}.pkl, "
          "<name>/{train,test}.npz (arrays x, y), or <name>/{train,test}/<digit>/*.png")
LAYOUT_MNISTM = LAYOUT + ", or mnist_m/mnist_m_{train,test}/*.png with mnist_m_{train,test}_labels.txt"
NPZ_KEYS = (("x", "y"), ("images", "labels"), ("X", "y"))
MEAN, STD = 0.5, 0.5
CLASS_NAMES = [str(d) for d in range(10)]


def _digit_dirs(split: Path) -> list[Path]:
    return [d for d in split.iterdir() if d.is_dir() and not d.name.startswith(".")] if split.is_dir() else []


def _form(folder: Path, name: str) -> Optional[str]:
    def has(*names: str) -> bool:
        return all((folder / n).is_file() for n in names)

    if has("partitions/train_part0.pkl", "test.pkl"):
        return "partitions"
    if has("train.pkl", "test.pkl"):
        return "pkl"
    if has("train.npz", "test.npz"):
        return "npz"
    if _digit_dirs(folder / "train") and _digit_dirs(folder / "test"):
        return "folders"
    if name == "mnistm" and has("mnist_m_train_labels.txt", "mnist_m_test_labels.txt"):
        return "mnistm_release"
    return None


def _probe_for(name: str):
    # These forms look alike for every dataset, so only a folder named like this one is accepted: a root
    # holding another dataset's files must not be read as this one.
    names = {n.lower() for n in FOLDER_NAMES[name]}

    def probe(folder: Path) -> Optional[tuple[str, Path]]:
        form = _form(folder, name) if folder.name.lower() in names else None
        return (form, folder) if form else None
    return probe


def arrays_to_raw(images: Any, labels: Any, path: Path, title: str, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 [N, H, W, 3] or [N, H, W] and labels -> uint8 [N, C, H, W] and int64 labels."""
    x = np.asarray(images)
    if x.dtype != np.uint8 or not (x.ndim == 3 or (x.ndim == 4 and x.shape[-1] == 3)):
        raise corrupt(path, title, layout, f"images are {x.dtype} {x.shape}, expected uint8 [N, H, W, 3] or [N, H, W]")
    tensor = torch.from_numpy(np.ascontiguousarray(x[:, None] if x.ndim == 3 else x.transpose(0, 3, 1, 2)))
    y = labels_int64(labels, 10, path, title, layout)
    check_lengths(tensor, y, path, title, layout)
    return tensor, y


def read_pair_pickle(path: Path, title: str, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    pair = load_pickle(path, title, layout)
    if not isinstance(pair, (tuple, list)) or len(pair) != 2:
        raise corrupt(path, title, layout, f"holds {type(pair).__name__}, expected an (images, labels) pair")
    return arrays_to_raw(pair[0], pair[1], path, title, layout)


def read_npz(path: Path, title: str, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    try:
        with np.load(path, allow_pickle=False) as npz:
            keys = next((k for k in NPZ_KEYS if set(k) <= set(npz.files)), None)
            if keys is None:
                raise corrupt(path, title, layout,
                              f"arrays {sorted(npz.files)}; expected x and y (or images and labels)")
            images, labels = npz[keys[0]], npz[keys[1]]
    except (OSError, ValueError, EOFError) as err:
        raise corrupt(path, title, layout, f"{type(err).__name__}: {err}") from None
    return arrays_to_raw(images, labels, path, title, layout)


def read_partitions(folder: Path, title: str, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    parts = []
    while (folder / "partitions" / f"train_part{len(parts)}.pkl").is_file():
        parts.append(read_pair_pickle(folder / "partitions" / f"train_part{len(parts)}.pkl", title, layout))
    shapes = {tuple(x.shape[1:]) for x, _ in parts}
    if len(shapes) > 1:
        raise corrupt(folder / "partitions", title, layout, f"parts hold images of different shapes {sorted(shapes)}")
    return torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])


def read_folders(split: Path, title: str, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    paths, labels = [], []
    for digit_dir in sorted(_digit_dirs(split)):
        if digit_dir.name not in CLASS_NAMES:
            raise corrupt(digit_dir, title, layout, "class folders must be named 0..9")
        files = list_images(digit_dir)
        paths += files
        labels += [int(digit_dir.name)] * len(files)
    return decode_images(paths, None, layout), torch.tensor(labels, dtype=torch.int64)


def read_label_list(folder: Path, split: str, title: str, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    listing = folder / f"mnist_m_{split}_labels.txt"
    paths, labels = [], []
    for line_no, line in enumerate(read_text(listing, title, layout).splitlines(), 1):
        if not line.strip():
            continue
        fields = line.split()
        if len(fields) != 2 or not fields[1].isdigit() or int(fields[1]) > 9:
            raise corrupt(listing, title, layout, f"line {line_no} is not '<file> <digit>': {line[:80]!r}")
        paths.append(folder / f"mnist_m_{split}" / fields[0])
        labels.append(int(fields[1]))
    return decode_images(paths, None, layout), torch.tensor(labels, dtype=torch.int64)


def read_digit_files(name: str, root: Optional[str]) -> RawImages:
    title = TITLES[name]
    layout = ((LAYOUT_MNISTM if name == "mnistm" else LAYOUT).replace("<name>", name)
              + f"; the {name}/ folder may also be named {', '.join(FOLDER_NAMES[name][1:])}")
    form, folder = find_or_fetch(title, root, name, FOLDER_NAMES[name] + ("",), _probe_for(name), layout,
                                 how="It has no official download: use the files federated-learning repositories "
                                     "(FedBN's among them) distribute.")
    if form == "partitions":
        train, test = read_partitions(folder, title, layout), read_pair_pickle(folder / "test.pkl", title, layout)
    elif form == "pkl":
        train, test = (read_pair_pickle(folder / f"{s}.pkl", title, layout) for s in ("train", "test"))
    elif form == "npz":
        train, test = (read_npz(folder / f"{s}.npz", title, layout) for s in ("train", "test"))
    elif form == "folders":
        train, test = (read_folders(folder / s, title, layout) for s in ("train", "test"))
    else:
        train, test = (read_label_list(folder, s, title, layout) for s in ("train", "test"))
    if train[0].shape[1:] != test[0].shape[1:]:
        raise corrupt(folder, title, layout, f"train images are {tuple(train[0].shape[1:])} but test images "
                                             f"{tuple(test[0].shape[1:])}")
    return RawImages(*train, *test, list(CLASS_NAMES))


def read_synthdigits(root: Optional[str]) -> RawImages:
    return read_digit_files("synthdigits", root)


def read_mnistm(root: Optional[str]) -> RawImages:
    return read_digit_files("mnistm", root)


@DATASETS.register("synthdigits", params=SourceParams,
                   summary="SynthDigits (FedBN pickles, npz or image folders), 10 classes, RGB")
def load_synthdigits(params: SourceParams) -> DatasetSplits:
    return to_splits(read_synthdigits(params.root), MEAN, STD)


@DATASETS.register("mnistm", params=SourceParams,
                   summary="MNIST-M (FedBN pickles, npz, image folders or the first release), 10 classes, RGB")
def load_mnistm(params: SourceParams) -> DatasetSplits:
    return to_splits(read_mnistm(params.root), MEAN, STD)
