"""Finding, fetching and opening a dataset's own files: the machinery every file-based source shares.

What it holds: where to look (data.root, then $FEDGUIDE_DATA, then any system folder a source names, then
the download folder, each with the sub-folders a dataset is commonly unpacked to), the download as a last
resort, the one wording of "not found" (where it looked, why no download helped, how to get the data, the
layout expected) and of "corrupt" errors, safe unpacking of archives, a pickle reader that accepts only
plain data and numpy arrays, and the checks of labels and lengths read from such files.

Decisions:
- A loader's sub-folders are tried in the order it lists them, all of them for one base before the next
  base, so data.root always wins over $FEDGUIDE_DATA.
- Downloads land in ``download_dir(name)``, which is also searched, so the next run finds them offline.
- FEDGUIDE_OFFLINE=1 is checked before anything is fetched or a download folder created; an archive that
  already lies in a searched folder may still be unpacked (that needs no network).
- Downloads are written to a temporary file beside their destination and renamed when complete, and
  archives are unpacked into a hidden staging folder and moved into place only when complete, so an
  interrupted run never leaves a half dataset; members with absolute paths, ``..`` or links are refused.
- Pickles can run code when loaded; the datasets that ship as pickles hold only dicts, lists, strings and
  numpy arrays, so any other global in the stream is refused. ``latin1`` decodes Python 2 pickles
  (CIFAR) the way numpy expects.
"""
from __future__ import annotations

import contextlib
import contextvars
import importlib
import os
import pickle
import shutil
import sys
import tarfile
import tempfile
import warnings
import zipfile
import zlib
from pathlib import Path, PurePosixPath
from typing import Any, Callable, Iterator, Optional, Sequence, TypeVar

import numpy as np
import torch

from fedguide.registry import ConfigError

T = TypeVar("T")
Probe = Callable[[Path], Optional[T]]
# Failures of a download or an unpack that mean "fetching did not work", not a bug.
FETCH_ERRORS = (OSError, EOFError, zlib.error, tarfile.TarError, zipfile.BadZipFile)
OFFLINE_REASON = "downloads disabled by FEDGUIDE_OFFLINE=1"


# ---- where to look -------------------------------------------------------------------------------

def offline() -> bool:
    """Downloads are off when FEDGUIDE_OFFLINE=1 (tests and air-gapped machines set it)."""
    return os.environ.get("FEDGUIDE_OFFLINE") == "1"


# Why fetching is off for the work in progress (a --dry-run checks a config without downloading a data set or
# creating its download folder); None: fetching is allowed.
_NO_FETCH: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar("fedguide_no_fetch", default=None)


@contextlib.contextmanager
def no_downloads(reason: str) -> Iterator[None]:
    """Within the block a data set that is not on disk is an error saying ``reason``, never a download."""
    token = _NO_FETCH.set(reason)
    try:
        yield
    finally:
        _NO_FETCH.reset(token)


def download_dir(name: str) -> Path:
    """Where downloads of dataset ``name`` go: $FEDGUIDE_DATA/<name> or ~/.cache/fedguide/<name>."""
    base = os.environ.get("FEDGUIDE_DATA") or os.path.join(os.path.expanduser("~"), ".cache", "fedguide")
    return Path(base) / name


_WARNED_ENV: set[str] = set()  # a $FEDGUIDE_DATA that is not a folder, said once per process


def search_bases(root: Optional[str], name: str, system_dirs: Sequence[str] = ()) -> list[Path]:
    """Where to look, in order and without repeats: data.root, $FEDGUIDE_DATA, system folders, the download folder."""
    bases = [Path(root).expanduser()] if root else []
    if os.environ.get("FEDGUIDE_DATA"):
        env = Path(os.environ["FEDGUIDE_DATA"]).expanduser()
        if not env.is_dir() and str(env) not in _WARNED_ENV:
            # A mistyped variable would otherwise go unseen while a copy elsewhere (or a fresh download) is used.
            _WARNED_ENV.add(str(env))
            print(f"warning: $FEDGUIDE_DATA is {env}, which is not a folder; data sets are looked for in the other "
                  "places (downloads would create it). Fix or unset the variable", file=sys.stderr)
        bases.append(env)
    bases += [Path(d) for d in system_dirs] + [download_dir(name)]
    return list(dict.fromkeys(bases))


def search_folders(bases: Sequence[Path], subfolders: Sequence[str]) -> list[Path]:
    """Every base joined with every sub-folder ("" is the base itself), in search order, without repeats."""
    return list(dict.fromkeys(base / sub if sub else base for base in bases for sub in subfolders))


def first_found(folders: Sequence[Path], probe: Probe[T]) -> Optional[T]:
    for folder in folders:
        if folder.is_dir():
            hit = probe(folder)
            if hit is not None:
                return hit
    return None


def has_paths(files: Sequence[str] = (), dirs: Sequence[str] = ()) -> Probe[Path]:
    """A probe that accepts a folder holding all these files and sub-folders (paths relative to it)."""
    def probe(folder: Path) -> Optional[Path]:
        ok = all((folder / f).is_file() for f in files) and all((folder / d).is_dir() for d in dirs)
        return folder if ok else None
    return probe


def not_found(title: str, bases: Sequence[Path], subfolders: Sequence[str], layout: str,
              url: Optional[str] = None, reason: str = "", how: str = "") -> ConfigError:
    """The one "not found" error: where it looked, why the download did not help, how to get it, the layout."""
    where = ", ".join(str(b) for b in bases)
    if any(subfolders):
        where += "; in each, " + ", ".join(f"{s}/" if s else "the folder itself" for s in subfolders)
    failed = f" and the download from {url} failed ({reason})" if url else ""
    return ConfigError(f"{title} not found (looked in {where}){failed}. {how + ' ' if how else ''}"
                       f"Set data.root (or FEDGUIDE_DATA) to the folder holding it. Expected layout: {layout}")


def find_or_fetch(title: str, root: Optional[str], name: str, subfolders: Sequence[str], probe: Probe[T],
                  layout: str, url: Optional[str] = None, fetch: Optional[Callable[[Path], None]] = None,
                  how: str = "", system_dirs: Sequence[str] = ()) -> T:
    """The first searched folder ``probe`` accepts; failing that, ``fetch`` into the download folder and
    probe there; failing that, the standard "not found" error (``how`` says where the data comes from)."""
    bases = search_bases(root, name, system_dirs)
    hit = first_found(search_folders(bases, subfolders), probe)
    if hit is not None:
        return hit
    if fetch is None:
        raise not_found(title, bases, subfolders, layout, how=how)
    if _NO_FETCH.get() is not None:
        raise not_found(title, bases, subfolders, layout, how=how + (" " if how else "") + _NO_FETCH.get())
    target = download_dir(name)
    try:
        fetch(target)
    except FETCH_ERRORS as err:
        raise not_found(title, bases, subfolders, layout, url, str(err), how) from None
    hit = first_found(search_folders([target], subfolders), probe)
    if hit is None:
        raise ConfigError(f"{title} was fetched into {target}, but the files there are not in the expected "
                          f"layout; delete {target} and try again. Expected layout: {layout}")
    return hit


# ---- fetching and unpacking ------------------------------------------------------------------------

def download_file(url: str, dest: Path, timeout: float = 30.0) -> Path:
    """Fetch ``url`` to ``dest`` (in an existing folder) atomically: a temporary file beside it, renamed when
    complete, so an interrupted download never leaves a half file that a later run would take for the dataset."""
    import urllib.request

    with tempfile.NamedTemporaryFile(dir=dest.parent, delete=False) as tmp:
        try:
            with urllib.request.urlopen(url, timeout=timeout) as resp:
                shutil.copyfileobj(resp, tmp)
        except BaseException:
            tmp.close()
            os.unlink(tmp.name)
            raise
    os.replace(tmp.name, dest)
    return dest


def _download(url: str, dest: Path) -> None:
    if offline():  # checked before download_file, so nothing touches the network or the disk
        raise OSError(OFFLINE_REASON)
    dest.parent.mkdir(parents=True, exist_ok=True)
    download_file(url, dest)


def fetch_files(urls: dict[str, str]) -> Callable[[Path], None]:
    """A fetch that downloads each missing file name -> url into the target folder."""
    def fetch(target: Path) -> None:
        for filename, url in urls.items():
            if not (target / filename).is_file():
                _download(url, target / filename)
    return fetch


def fetch_archive(url: str, archive_name: str) -> Callable[[Path], None]:
    """A fetch that downloads one archive, unpacks it into the target folder, then deletes it."""
    def fetch(target: Path) -> None:
        archive = target / archive_name
        if not archive.is_file():
            _download(url, archive)
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
    """Unpack a .zip or .tar[.gz] into ``dest`` (created if missing), atomically per top-level entry."""
    dest.mkdir(parents=True, exist_ok=True)
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


# ---- reading what was found ------------------------------------------------------------------------

def corrupt(path: Path, title: str, layout: str, detail: Any) -> ConfigError:
    return ConfigError(f"{path} is not readable as {title} data ({detail}); re-download it. "
                       f"Expected layout: {layout}.")


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


def read_text(path: Path, title: str, layout: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise corrupt(path, title, layout, f"{type(err).__name__}: {err}") from None


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
