"""Tiny ImageNet (200 classes, 64x64 RGB) from the official ``tiny-imagenet-200`` folder, with its download.

Layout: ``tiny-imagenet-200/`` under data.root or $FEDGUIDE_DATA (directly, or in a ``tinyimagenet``
sub-folder, or the root being that folder) holding ``wnids.txt`` (the 200 WordNet ids),
``words.txt`` (id <tab> names), ``train/<wnid>/images/*.JPEG`` (500 per class) and ``val/images/*.JPEG``
with ``val/val_annotations.txt`` (file <tab> wnid <tab> box).

Decisions:
- The labelled ``val`` split is the test split; the official ``test`` images carry no labels and are unused.
- Label order is the sorted wnids (the order of an image-folder reader over ``train/``), not wnids.txt's.
- A class name is the first synonym in words.txt ("goldfish" for "goldfish, Carassius auratus"); the wnid
  itself when words.txt is absent.
- Images are listed and decoded like every image-file source (see ``_images``): greyscale JPEGs (a few
  dozen in train) become RGB; an ``image_size`` other than 64 resizes them (bilinear, from the full image).
- Normalisation: mean (0.4802, 0.4481, 0.3975), std (0.2302, 0.2265, 0.2262), the commonly used statistics.
- Memory: the 110k images are held in memory; at 64x64 the float32 tensors take about 5.4 GB
  (4.9 GB train), plus a 1.4 GB uint8 copy while loading. Lower image_size to shrink both.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
from pydantic import Field

from fedguide.data.sources._files import corrupt, fetch_archive, find_or_fetch, has_paths, read_text
from fedguide.data.sources._images import RawImages, decode_images, list_images, to_splits
from fedguide.data.sources.base import DATASETS, DatasetSplits, SourceParams

URL = "http://cs231n.stanford.edu/tiny-imagenet-200.zip"
FOLDER = "tiny-imagenet-200"
SUBFOLDERS = (FOLDER, f"tinyimagenet/{FOLDER}", "tinyimagenet", "")
LAYOUT = (f"{FOLDER}/{{wnids.txt, words.txt, train/<wnid>/images/*.JPEG, val/images/*.JPEG, "
          "val/val_annotations.txt}} (unpacked tiny-imagenet-200.zip)")
MEAN, STD = (0.4802, 0.4481, 0.3975), (0.2302, 0.2265, 0.2262)
TITLE = "Tiny ImageNet"


class TinyImageNetParams(SourceParams):
    image_size: int = Field(64, ge=8, le=512, description="side of the square images; 64 is the native size")


def class_names(folder: Path, wnids: list[str]) -> list[str]:
    words = {}
    if (folder / "words.txt").is_file():
        for line in read_text(folder / "words.txt", TITLE, LAYOUT).splitlines():
            wnid, _, names = line.partition("\t")
            words[wnid.strip()] = names.split(",")[0].strip()
    return [words.get(w) or w for w in wnids]


def read_tinyimagenet(root: Optional[str], image_size: int = 64) -> RawImages:
    folder = find_or_fetch(TITLE, root, "tinyimagenet", SUBFOLDERS,
                           has_paths(("wnids.txt", "val/val_annotations.txt"), ("train", "val/images")), LAYOUT, URL,
                           fetch_archive(URL, "tiny-imagenet-200.zip"))
    wnids = sorted({w.strip() for w in read_text(folder / "wnids.txt", TITLE, LAYOUT).split() if w.strip()})
    if not wnids:
        raise corrupt(folder / "wnids.txt", TITLE, LAYOUT, "no class ids")
    index = {w: i for i, w in enumerate(wnids)}

    train_paths, train_labels = [], []
    for wnid in wnids:
        images = folder / "train" / wnid / "images"
        paths = list_images(images) if images.is_dir() else []
        if not paths:
            raise corrupt(images, TITLE, LAYOUT, f"no training images for class {wnid}")
        train_paths += paths
        train_labels += [index[wnid]] * len(paths)

    annotations = folder / "val" / "val_annotations.txt"
    test_paths, test_labels = [], []
    for line_no, line in enumerate(read_text(annotations, TITLE, LAYOUT).splitlines(), 1):
        fields = line.split("\t")
        if not line.strip():
            continue
        if len(fields) < 2 or fields[1].strip() not in index:
            raise corrupt(annotations, TITLE, LAYOUT, f"line {line_no} names no known wnid: {line[:80]!r}")
        path = folder / "val" / "images" / fields[0].strip()
        if not path.is_file():
            raise corrupt(annotations, TITLE, LAYOUT, f"line {line_no} names the missing image {path}")
        test_paths.append(path)
        test_labels.append(index[fields[1].strip()])

    return RawImages(
        decode_images(train_paths, image_size, LAYOUT), torch.tensor(train_labels, dtype=torch.int64),
        decode_images(test_paths, image_size, LAYOUT), torch.tensor(test_labels, dtype=torch.int64),
        class_names(folder, wnids))


@DATASETS.register("tinyimagenet", params=TinyImageNetParams,
                   summary="Tiny ImageNet (official folder), 200 classes, 64x64 RGB; val is the test split")
def load_tinyimagenet(params: TinyImageNetParams) -> DatasetSplits:
    return to_splits(read_tinyimagenet(params.root, params.image_size), MEAN, STD)
