"""Helpers shared by the benchmark sources that read a dataset's own distribution files.

What they share: where to look (data.root, then $FEDGUIDE_DATA, then the download folder, each with
the sub-folders a dataset is commonly unpacked to), the download as a last resort, one wording for
"not found" and "corrupt" errors that names the expected layout, safe unpacking of archives, a
pickle reader that accepts only plain data and numpy arrays, and per-channel normalisation.

Decisions:
- A loader's sub-folders are tried in the order it lists them, all of them for one base before the next
  base, so data.root always wins over $FEDGUIDE_DATA.
- Downloads land in ``download_dir(name)``, which is also searched, so the next run finds them offline.
- Archives are unpacked into a hidden staging folder and moved into place only when complete, so an
  interrupted unpack never leaves a half dataset; members with absolute paths, ``..`` or links are refused.
- Pickles can run code when loaded; the datasets that ship as pickles hold only dicts, lists, strings and
  numpy arrays, so any other global in the stream is refused. ``latin1`` decodes Python 2 pickles
  (CIFAR) the way numpy expects.
"""
from __future__ import annotations

import importlib
import os
import pickle
import shutil
import tarfile
import tempfile
import warnings
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Callable, Optional, Sequence, TypeVar

import numpy as np
import torch

from fedguide.data.sources.base import (DatasetSplits, candidate_roots, download_dir, download_file, normalise,
                                        offline)
from fedguide.registry import ConfigError

T = TypeVar("T")
# Failures of a download or an unpack that mean "fetching did not work", not a bug.
FETCH_ERRORS = (OSError, EOFError, zlib.error, tarfile.TarError, zipfile.BadZipFile)


@dataclass
class RawImages:
    """A dataset before normalisation: uint8 [N, C, H, W] images and int64 labels."""

    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    class_names: list[str]


def search_bases(root: Optional[str], name: str) -> list[Path]:
    bases = candidate_roots(root, "FEDGUIDE_DATA") + [download_dir(name)]
    return list(dict.fromkeys(bases))


def search_folders(root: Optional[str], name: str, subfolders: Sequence[str]) -> list[Path]:
    """Every base joined with every sub-folder ("" is the base itself), in search order, without repeats."""
    return list(dict.fromkeys(base / sub if sub else base for base in search_bases(root, name) for sub in subfolders))


def first_found(folders: Sequence[Path], probe: Callable[[Path], Optional[T]]) -> Optional[T]:
    for folder in folders:
        if folder.is_dir():
            hit = probe(folder)
            if hit is not None:
                return hit
    return None


def not_found(title: str, root: Optional[str], name: str, layout: str, url: Optional[str],
              reason: str = "") -> ConfigError:
    looked = ", ".join(str(p) for p in search_bases(root, name))
    if url:
        why = f"and the download from {url} failed ({reason})"
    else:
        why = "and it has no official download"
    return ConfigError(f"{title} not found (looked in {looked}) {why}. "
                       f"Fix: set data.root or FEDGUIDE_DATA to a folder holding {layout}.")


def corrupt(path: Path, title: str, layout: str, detail: Any) -> ConfigError:
    return ConfigError(f"{path} is not readable as {title} data ({detail}); re-download it. "
                       f"Expected layout: {layout}.")


def find_or_fetch(title: str, root: Optional[str], name: str, subfolders: Sequence[str],
                  probe: Callable[[Path], Optional[T]], layout: str,
                  url: Optional[str] = None, fetch: Optional[Callable[[Path], None]] = None) -> T:
    """The first folder ``probe`` accepts; failing that, ``fetch`` into the download folder and probe there."""
    hit = first_found(search_folders(root, name, subfolders), probe)
    if hit is not None:
        return hit
    if fetch is None:
        raise not_found(title, root, name, layout, None)
    target = download_dir(name)
    try:
        if offline():  # checked before any network access is attempted
            raise OSError("downloads disabled by FEDGUIDE_OFFLINE=1")
        target.mkdir(parents=True, exist_ok=True)
        fetch(target)
    except FETCH_ERRORS as err:
        raise not_found(title, root, name, layout, url, str(err)) from None
    hit = first_found([target / sub if sub else target for sub in subfolders], probe)
    if hit is None:
        raise ConfigError(f"{title} was downloaded from {url} into {target}, but the files are not in the "
                          f"expected layout ({layout}); delete {target} and try again")
    return hit


def fetch_files(urls: dict[str, str]) -> Callable[[Path], None]:
    """A fetch that downloads each missing file name -> url into the target folder."""
    def fetch(target: Path) -> None:
        for filename, url in urls.items():
            if not (target / filename).is_file():
                download_file(url, target / filename)
    return fetch


def fetch_archive(url: str, archive_name: str) -> Callable[[Path], None]:
    """A fetch that downloads one archive, unpacks it into the target folder, then deletes it."""
    def fetch(target: Path) -> None:
        archive = target / archive_name
        if not archive.is_file():
            download_file(url, archive)
        try:
            unpack(archive, target)
        finally:
            archive.unlink(missing_ok=True)  # a damaged archive must not be reused by the next try
    return fetch


def _check_member(archive: Path, member: str) -> None:
    parts = PurePosixPath(member.replace("\\", "/")).parts
    if member.startswith(("/", "\\")) or ".." in parts or (parts and ":" in parts[0]):
        raise OSError(f"{archive} holds the unsafe path {member!r}; refusing to unpack it")


def unpack(archive: Path, dest: Path) -> None:
    """Unpack a .zip or .tar[.gz] into ``dest``, atomically per top-level entry."""
    staging = Path(tempfile.mkdtemp(dir=dest, prefix=".unpack-"))
    try:
        if zipfile.is_zipfile(archive):
            with zipfile.ZipFile(archive) as zf:
                for member in zf.namelist():
                    _check_member(archive, member)
                zf.extractall(staging)
        else:
            with tarfile.open(archive) as tf:
                for member in tf.getmembers():
                    _check_member(archive, member.name)
                    if not (member.isfile() or member.isdir()):
                        raise OSError(f"{archive} holds a link or device ({member.name}); refusing to unpack it")
                if hasattr(tarfile, "data_filter"):
                    tf.extractall(staging, filter="data")
                else:
                    tf.extractall(staging)
        for entry in staging.iterdir():
            final = dest / entry.name
            if final.is_dir():
                shutil.rmtree(final)
            elif final.exists():
                final.unlink()
            os.replace(entry, final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


# numpy >= 2 pickles name numpy._core, older ones numpy.core: both spellings are the same function.
_PICKLE_GLOBALS = {
    ("numpy.core.multiarray", "_reconstruct"), ("numpy.core.multiarray", "scalar"),
    ("numpy.core.numeric", "_frombuffer"), ("numpy", "ndarray"), ("numpy", "dtype"), ("_codecs", "encode"),
}


class _DataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        canonical = module.replace("numpy._core", "numpy.core")
        if (canonical, name) not in _PICKLE_GLOBALS:
            raise pickle.UnpicklingError(f"it refers to {module}.{name}; a dataset pickle holds only data")
        for spelling in (module, canonical.replace("numpy.core", "numpy._core"), canonical):
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", DeprecationWarning)
                    return getattr(importlib.import_module(spelling), name)
            except (ImportError, AttributeError):
                continue
        raise pickle.UnpicklingError(f"numpy cannot resolve {module}.{name}")


def load_pickle(path: Path, title: str, layout: str) -> Any:
    try:
        with open(path, "rb") as fh:
            return _DataUnpickler(fh, encoding="latin1").load()
    except Exception as err:  # noqa: BLE001  (a damaged pickle fails in many ways; each means "re-download")
        raise corrupt(path, title, layout, f"{type(err).__name__}: {err}") from None


def field(record: Any, key: str, path: Path, title: str, layout: str) -> Any:
    """``record[key]`` for a dict pickled with str or bytes keys (Python 2 and 3 writers differ)."""
    if isinstance(record, dict):
        for k in (key, key.encode()):
            if k in record:
                return record[k]
    raise corrupt(path, title, layout, f"no '{key}' entry")


def as_text(value: Any) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def labels_int64(labels: Any, num_classes: int, path: Path, title: str, layout: str) -> torch.Tensor:
    """Integer labels in [0, num_classes), from any numeric array or list; a [N, 1] column is flattened."""
    arr = np.asarray(labels).reshape(-1)
    if arr.size and (arr.dtype.kind not in "iuf" or not np.all(arr == np.round(arr))):
        raise corrupt(path, title, layout, f"labels of dtype {arr.dtype} are not integers")
    arr = arr.astype(np.int64)
    if arr.size and (arr.min() < 0 or arr.max() >= num_classes):
        raise corrupt(path, title, layout, f"labels span {arr.min()}..{arr.max()}, expected 0..{num_classes - 1}")
    return torch.from_numpy(arr)


def check_lengths(images: torch.Tensor, labels: torch.Tensor, path: Path, title: str, layout: str) -> None:
    if len(images) != len(labels):
        raise corrupt(path, title, layout, f"{len(images)} images but {len(labels)} labels")


def normalise_channels(images_uint8: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """uint8 [N, C, H, W] -> float32 standardised per channel."""
    # Contiguous uint8 first: normalising a permuted view would copy the (4x larger) float result instead.
    x = images_uint8.contiguous()
    return normalise(x, torch.tensor(mean).view(-1, 1, 1), torch.tensor(std).view(-1, 1, 1))  # type: ignore[arg-type]


def to_splits(raw: RawImages, mean: Sequence[float], std: Sequence[float]) -> DatasetSplits:
    return DatasetSplits(normalise_channels(raw.train_x, mean, std), raw.train_y,
                         normalise_channels(raw.test_x, mean, std), raw.test_y, raw.class_names)


def read_text(path: Path, title: str, layout: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise corrupt(path, title, layout, f"{type(err).__name__}: {err}") from None


def read_rgb(path: Path, title: str, layout: str, size: Optional[int] = None) -> np.ndarray:
    """One image file as uint8 [3, H, W]; resized (bilinear) to size x size when ``size`` is given."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as img:
            rgb = img.convert("RGB")  # grey or palette images become 3 equal channels
            if size is not None and rgb.size != (size, size):
                rgb = rgb.resize((size, size), Image.BILINEAR)
            return np.asarray(rgb, dtype=np.uint8).transpose(2, 0, 1)
    except (OSError, UnidentifiedImageError, ValueError) as err:
        raise corrupt(path, title, layout, f"{type(err).__name__}: {err}") from None


def read_rgb_stack(paths: Sequence[Path], title: str, layout: str, size: Optional[int] = None) -> torch.Tensor:
    """Image files as uint8 [N, 3, H, W]; without ``size`` all must share the first one's size."""
    out: Optional[np.ndarray] = None
    for i, path in enumerate(paths):
        image = read_rgb(path, title, layout, size)
        if out is None:  # filled in place, so no list of arrays is held next to the result
            out = np.empty((len(paths), *image.shape), dtype=np.uint8)
        elif image.shape != out.shape[1:]:
            raise corrupt(path, title, layout, f"{image.shape[2]}x{image.shape[1]} pixels while {paths[0].name} "
                                               f"has {out.shape[3]}x{out.shape[2]}; all images must share one size")
        out[i] = image
    return torch.from_numpy(out if out is not None else np.zeros((0, 3, size or 1, size or 1), dtype=np.uint8))
