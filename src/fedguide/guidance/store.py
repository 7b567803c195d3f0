"""An on-disk cache of frozen-model features (e.g. diffusion UNet features of a dataset split).

Features are expensive (minutes to hours of GPU time), so they are computed once, in batches and with
a progress bar, written to disk and memory-mapped on every later use. While they are computed, each
finished chunk of ~1024 items is kept on disk (feature_chunks.py), so an interrupted extraction, run
again, computes only the chunks it lacks and ends with the same bytes an uninterrupted one writes.
A cache is identified by a ``FeatureKey``: model id with revision or weights hash, dataset, split,
fraction, the recipe (a JSON description of how the features are made: layer, timestep, resolution,
...) and the seed.

Layout on disk, one directory per key under the store's root::

    root/<dataset>-<split>-<digest>/
        features.npy   # one .npy array [num_items, *feature_shape], read back with np.load(mmap_mode="r")
        meta.json      # {format, key, shape, dtype, sha256, num_items, created, fedguide_version}

``digest`` is the first 16 hex chars of the sha256 of the key's canonical JSON; dataset and split are
in the name only so a person can tell the folders apart (characters outside ``[A-Za-z0-9._-]`` become
``_``); the digest alone tells keys apart.

Decisions:

- Validation on open: meta.json must hold exactly the requested key (a digest collision or a
  hand-edited folder is caught, never silently used), its shape and dtype must match the .npy header,
  the file size must match what the header promises (a truncated file is caught), and by default the
  sha256 of the whole data file must match the one recorded at write time. Any failure raises
  ``FeatureCacheError`` naming the file and the fix (delete the folder or rerun with ``--rebuild``).
- The checksum reads the whole file on every open: about a second per 1-2 GB on a current CPU, small
  next to the GPU time the features cost. For very large caches ``verify="header"`` keeps every check
  but the checksum (key, shape, dtype, size), so opening is instant.
- A cache whose item count or dtype differs from what ``get_or_compute`` is asked for is an error, not
  a recompute: the key should have told them apart, so the caller's key is incomplete.
- The model must name a revision or weights hash (``id@revision``): features of a bare model id would
  silently go stale when the weights behind that id change.
- Recipe values are canonicalised through JSON (tuples become lists); ``1`` and ``1.0`` are different
  recipes, as JSON keeps them apart.
- Writes are atomic: the cache is built in a hidden sibling temp folder, fsynced, then renamed into
  place, so a half-written cache never sits at the final path. A rebuild renames the old folder aside,
  renames the new one in, and only then deletes the old one. If the process dies between those two
  renames the final path is absent (the next run recomputes) and the old folder remains under
  ``.<name>.old-*``; a killed build leaves a ``.<name>.tmp-*`` folder. Both are hidden, never read, and
  safe to delete; they are not swept automatically because another process may be writing them.
- An interrupted extraction leaves its finished chunks in ``.<name>.chunks`` (hidden, read by the next
  extraction of the same key, removed once the cache is installed; a rebuild discards them). Deleting
  the folder costs only the recomputation. A failure before the first chunk is finished leaves nothing.
- If another process finishes the same key first, its cache is validated and used, and ours dropped.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import sys
import tempfile
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Literal, Mapping

import numpy as np

from fedguide.core.checksums import file_sha256
from fedguide.guidance.feature_chunks import FeatureChunks
from fedguide.guidance.progress import progress as progress_bar
from fedguide.registry import ConfigError

DATA_FILE = "features.npy"
META_FILE = "meta.json"
FORMAT = 1  # bumped when the layout changes; an older folder is then reported, not misread
CHUNK_ITEMS = 1024  # items per finished chunk kept while computing (rounded up to whole batches)

_UNSAFE_NAME_CHARS = re.compile(r"[^A-Za-z0-9._-]")


class FeatureCacheError(ConfigError):
    """A feature cache on disk is corrupt or does not match its key; the message names the file and the fix."""


def _cache_error(file: Path, problem: str, folder: Path) -> FeatureCacheError:
    return FeatureCacheError(f"feature cache {file}: {problem}; delete {folder} or rerun with --rebuild")


def _canonical(value: Any, where: str) -> Any:
    """A JSON-identical copy of ``value``; anything JSON would change or refuse is a ConfigError."""
    if isinstance(value, np.generic):
        value = value.item()
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ConfigError(f"{where} is {value}; a feature recipe holds finite numbers only")
        return value
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise ConfigError(f"{where} has key {k!r}; recipe keys must be strings")
            out[k] = _canonical(v, f"{where}.{k}")
        return out
    if isinstance(value, (list, tuple)):
        return [_canonical(v, f"{where}[{i}]") for i, v in enumerate(value)]
    raise ConfigError(f"{where} is a {type(value).__name__}; a feature recipe holds JSON values only "
                      "(str, int, float, bool, None, lists, string-keyed mappings)")


@dataclass(frozen=True)
class FeatureKey:
    """Everything that decides the features' values; two keys with equal ``as_dict()`` share a cache."""

    model: str
    dataset: str
    split: str
    fraction: float = 1.0
    recipe: Mapping[str, Any] = field(default_factory=dict)
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("model", "dataset", "split"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value.strip():
                raise ConfigError(f"FeatureKey.{name} must be a non-empty string, got {value!r}")
        model_id, _, revision = self.model.rpartition("@")
        if not model_id or not revision:
            raise ConfigError(f"FeatureKey.model '{self.model}' names no revision: write 'model_id@revision' "
                              "or 'model_id@<weights hash>' so changed weights give a new cache")
        if isinstance(self.fraction, bool) or not isinstance(self.fraction, (int, float, np.number)):
            raise ConfigError(f"FeatureKey.fraction must be a number in (0, 1], got {self.fraction!r}")
        fraction = float(self.fraction)
        if not 0.0 < fraction <= 1.0:
            raise ConfigError(f"FeatureKey.fraction must be in (0, 1], got {fraction}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer)):
            raise ConfigError(f"FeatureKey.seed must be an integer, got {self.seed!r}")
        if not isinstance(self.recipe, Mapping):
            raise ConfigError(f"FeatureKey.recipe must be a mapping, got {type(self.recipe).__name__}")
        # Frozen: normalised values are set once, so equality and the digest agree with the stored JSON.
        object.__setattr__(self, "fraction", fraction)
        object.__setattr__(self, "seed", int(self.seed))
        object.__setattr__(self, "recipe", _canonical(self.recipe, "FeatureKey.recipe"))

    def __hash__(self) -> int:  # the recipe is a dict, so the generated field hash would fail
        return hash(self.digest())

    def as_dict(self) -> dict:
        return {"model": self.model, "dataset": self.dataset, "split": self.split,
                "fraction": self.fraction, "recipe": json.loads(json.dumps(self.recipe)), "seed": self.seed}

    def canonical_json(self) -> str:
        return json.dumps(self.as_dict(), sort_keys=True, separators=(",", ":"), allow_nan=False)

    def digest(self) -> str:
        return hashlib.sha256(self.canonical_json().encode("utf-8")).hexdigest()[:16]


def _key_difference(stored: Any, wanted: dict) -> str:
    if not isinstance(stored, dict):
        return f"meta.json key is {type(stored).__name__}, not a key record"
    fields = sorted(set(stored) | set(wanted))
    diffs = [f"{f}: stored {json.dumps(stored.get(f))}, requested {json.dumps(wanted.get(f))}"
             for f in fields if stored.get(f) != wanted.get(f)]
    return "key mismatch (" + "; ".join(diffs) + ")"


def _read_npy_header(path: Path) -> tuple[tuple[int, ...], np.dtype, int]:
    """(shape, dtype, byte offset of the data) from a .npy header; ValueError if it is not one."""
    with open(path, "rb") as fh:
        version = np.lib.format.read_magic(fh)
        if version == (1, 0):
            shape, _, dtype = np.lib.format.read_array_header_1_0(fh)
        elif version == (2, 0):
            shape, _, dtype = np.lib.format.read_array_header_2_0(fh)
        else:
            raise ValueError(f"unsupported .npy version {version}")
        return tuple(shape), dtype, fh.tell()


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


def _fsync_dir(path: Path) -> None:
    # Makes a rename durable on POSIX; Windows cannot open a directory, and renames there are journaled.
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _fedguide_version() -> str:
    try:
        from importlib.metadata import PackageNotFoundError, version

        return version("fedguide")
    except PackageNotFoundError:
        import fedguide

        return getattr(fedguide, "__version__", "unknown")


def _as_numpy(batch: Any) -> np.ndarray:
    torch = sys.modules.get("torch")  # a tensor output means torch is already imported
    if torch is not None and isinstance(batch, torch.Tensor):
        batch = batch.detach().cpu()
        if batch.dtype == torch.bfloat16:  # numpy has no bfloat16
            batch = batch.float()
        return batch.numpy()
    return np.asarray(batch)


class FeatureStore:
    """Feature caches under ``root``, one folder per ``FeatureKey``."""

    def __init__(self, root: Path | str, verify: Literal["checksum", "header"] = "checksum"):
        if verify not in ("checksum", "header"):
            raise ConfigError(f"FeatureStore verify='{verify}' is unknown; valid choices: checksum, header")
        self.root = Path(root)
        self.verify = verify

    def path(self, key: FeatureKey) -> Path:
        dataset = _UNSAFE_NAME_CHARS.sub("_", key.dataset)
        split = _UNSAFE_NAME_CHARS.sub("_", key.split)
        return self.root / f"{dataset}-{split}-{key.digest()}"

    def exists(self, key: FeatureKey) -> bool:
        """Whether something sits at the key's path; ``open`` says whether it is valid."""
        path = self.path(key)
        return path.exists() or path.is_symlink()

    def clear(self, key: FeatureKey) -> None:
        _remove(self.path(key))

    def open(self, key: FeatureKey) -> np.ndarray | None:
        """The cached features as a read-only memmap, None if absent; FeatureCacheError if not valid."""
        folder = self.path(key)
        if not self.exists(key):
            return None
        if not folder.is_dir():
            raise _cache_error(folder, "is not a directory", folder)
        meta_path, data_path = folder / META_FILE, folder / DATA_FILE
        meta = self._read_meta(meta_path, folder)
        if meta["key"] != key.as_dict():
            raise _cache_error(meta_path, _key_difference(meta["key"], key.as_dict()), folder)
        if not data_path.is_file():
            raise _cache_error(data_path, "is missing", folder)
        try:
            shape, dtype, offset = _read_npy_header(data_path)
        except (ValueError, OSError, EOFError) as err:
            raise _cache_error(data_path, f"unreadable .npy header ({err})", folder) from None
        if shape != meta["shape"] or dtype != meta["dtype"]:
            raise _cache_error(data_path, f"header says shape {list(shape)} dtype {dtype.str}, meta.json says "
                               f"shape {list(meta['shape'])} dtype {meta['dtype'].str}", folder)
        if meta["num_items"] != (shape[0] if shape else None):
            raise _cache_error(meta_path, f"num_items {meta['num_items']} does not match shape {list(shape)}", folder)
        expected_size = offset + math.prod(shape) * dtype.itemsize
        actual_size = data_path.stat().st_size
        if actual_size != expected_size:
            what = "truncated" if actual_size < expected_size else "has trailing bytes"
            raise _cache_error(data_path, f"{what}: {actual_size} bytes, the header promises {expected_size}", folder)
        if self.verify == "checksum":
            actual = file_sha256(data_path)
            if actual != meta["sha256"]:
                raise _cache_error(data_path, f"checksum mismatch (sha256 {actual[:16]}..., meta.json records "
                                   f"{meta['sha256'][:16]}...): the file changed after it was written", folder)
        try:
            return np.load(data_path, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError) as err:
            raise _cache_error(data_path, f"cannot be memory-mapped ({err})", folder) from None

    def _read_meta(self, meta_path: Path, folder: Path) -> dict:
        if not meta_path.is_file():
            raise _cache_error(meta_path, "is missing (an incomplete or foreign folder)", folder)
        try:
            raw = json.loads(meta_path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise _cache_error(meta_path, f"unreadable JSON ({err})", folder) from None
        if not isinstance(raw, dict):
            raise _cache_error(meta_path, "is not a JSON object", folder)
        if raw.get("format") != FORMAT:
            raise _cache_error(meta_path, f"format {raw.get('format')!r}, this fedguide reads format {FORMAT}", folder)
        missing = [f for f in ("key", "shape", "dtype", "sha256", "num_items") if f not in raw]
        if missing:
            raise _cache_error(meta_path, f"lacks {', '.join(missing)}", folder)
        try:
            shape = raw["shape"]
            if not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape):
                raise TypeError(f"shape {shape!r} is not a list of sizes")
            dtype = np.dtype(raw["dtype"])
            if not isinstance(raw["sha256"], str) or not isinstance(raw["num_items"], int):
                raise TypeError("sha256 must be a string and num_items an integer")
        except TypeError as err:
            raise _cache_error(meta_path, f"malformed ({err})", folder) from None
        return {**raw, "shape": tuple(shape), "dtype": dtype}

    def chunks_path(self, key: FeatureKey) -> Path:
        """Where the finished chunks of an extraction of ``key`` in progress wait (feature_chunks.py)."""
        final = self.path(key)
        return final.with_name(f".{final.name}.chunks")

    def get_or_compute(self, key: FeatureKey, num_items: int,
                       compute: Callable[[np.ndarray], "np.ndarray | Any"],
                       batch_size: int = 64, rebuild: bool = False,
                       description: str = "features", progress: bool = True,
                       dtype: np.dtype | str = "float32", chunk_size: int = CHUNK_ITEMS) -> np.ndarray:
        """The cached features for ``key``, computing ``compute(indices)`` over ``range(num_items)`` if absent.

        ``compute`` gets consecutive index batches and returns ``[len(indices), *feature_shape]`` (numpy or
        torch). A corrupt cache raises unless ``rebuild``; ``rebuild`` recomputes and replaces it.
        Finished chunks of about ``chunk_size`` items (rounded up to whole batches) are kept until the
        cache is complete, so an interrupted extraction, run again, computes only the missing chunks;
        ``rebuild`` discards them as well.
        """
        for name, value in (("num_items", num_items), ("batch_size", batch_size), ("chunk_size", chunk_size)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        try:
            dtype = np.dtype(dtype)
        except TypeError as err:
            raise ConfigError(f"dtype {dtype!r} is not a numpy dtype ({err})") from None
        if dtype.hasobject:
            raise ConfigError(f"dtype {dtype} holds Python objects; features must be a plain numeric dtype")
        num_items, batch_size = int(num_items), int(batch_size)
        chunk_items = batch_size * -(-int(chunk_size) // batch_size)
        chunks = FeatureChunks(self.chunks_path(key), key.as_dict(), num_items, batch_size, chunk_items, dtype)
        if rebuild:
            chunks.discard()  # a rebuild distrusts what earlier code computed, finished chunks included
        else:
            cached = self.open(key)
            if cached is not None:
                self._check_request(key, cached, num_items, dtype)
                chunks.discard()  # left over if a process died between installing the cache and cleaning up
                return cached
        self.root.mkdir(parents=True, exist_ok=True)
        try:
            finished = self._compute_chunks(key, chunks, compute, batch_size, description, progress, rebuild)
        except BaseException:
            if not chunks.any_done():
                chunks.discard()
            raise
        if finished is not None:  # another process completed the cache meanwhile
            return finished
        final = self.path(key)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=self.root))
        try:
            self._assemble(tmp, key, chunks)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        features = self._install(tmp, final, key, num_items, dtype, replace=rebuild)
        chunks.discard()
        return features

    def _check_request(self, key: FeatureKey, cached: np.ndarray, num_items: int, dtype: np.dtype) -> None:
        folder = self.path(key)
        if cached.shape[0] != num_items or cached.dtype != dtype:
            raise _cache_error(folder / DATA_FILE, f"holds {cached.shape[0]} items of {cached.dtype}, asked for "
                               f"{num_items} of {dtype}: the key does not tell these features apart "
                               "(add what differs to its recipe)", folder)

    def _compute_chunks(self, key: FeatureKey, chunks: FeatureChunks, compute: Callable[[np.ndarray], Any],
                        batch_size: int, description: str, progress: bool, rebuild: bool) -> np.ndarray | None:
        """Computes and saves every chunk not yet done; the cache of another process if it finished first."""
        done = chunks.open()
        if len(set(done.values())) > 1:  # no single extraction makes these: start over
            chunks.discard()
            done = chunks.open()
        feature_shape = next(iter(done.values()), None)
        ranges = chunks.ranges()
        completed = sum(stop - start for start, stop in ranges if start in done)
        dtype = chunks.dtype
        with progress_bar(chunks.num_items, description, enabled=progress, unit="img", completed=completed) as advance:
            for start, stop in ranges:
                if start in done:
                    continue
                if not rebuild and self.exists(key):
                    cached = self.open(key)
                    if cached is not None:
                        self._check_request(key, cached, chunks.num_items, dtype)
                        return cached
                out = None if feature_shape is None else np.empty((stop - start, *feature_shape), dtype=dtype)
                for lo in range(start, stop, batch_size):
                    indices = np.arange(lo, min(lo + batch_size, stop))
                    batch = _as_numpy(compute(indices))
                    where = f"{description}: batch {lo // batch_size} (items {indices[0]}..{indices[-1]})"
                    if batch.ndim == 0 or batch.shape[0] != len(indices):
                        raise ValueError(f"{where} returned shape {list(batch.shape)}; expected {len(indices)} "
                                         "rows, one per index")
                    if feature_shape is None:
                        feature_shape = tuple(batch.shape[1:])
                        out = np.empty((stop - start, *feature_shape), dtype=dtype)
                    elif tuple(batch.shape[1:]) != feature_shape:
                        raise ValueError(f"{where} returned features of shape {list(batch.shape[1:])}; earlier "
                                         f"batches (or the finished chunks in {chunks.folder}) gave "
                                         f"{list(feature_shape)}")
                    if not np.can_cast(batch.dtype, dtype, casting="same_kind"):
                        raise ValueError(f"{where} returned {batch.dtype}, which does not cast safely to {dtype}; "
                                         "pass the matching dtype=")
                    out[lo - start:indices[-1] + 1 - start] = batch
                    advance(len(indices))
                chunks.save(start, stop, out)
        return None

    def _assemble(self, tmp: Path, key: FeatureKey, chunks: FeatureChunks) -> None:
        """The finished chunks, in order, as one features.npy with its meta.json in ``tmp``."""
        data_path = tmp / DATA_FILE
        out = None
        for start, stop in chunks.ranges():
            data = chunks.load(start, stop)
            if data is None:
                raise _cache_error(chunks.folder, f"chunk of items {start}..{stop - 1} is missing or changed "
                                   "after it was checked", chunks.folder)
            if out is None:
                out = np.lib.format.open_memmap(data_path, mode="w+", dtype=chunks.dtype,
                                                shape=(chunks.num_items, *data.shape[1:]))
            out[start:stop] = data
        out.flush()
        shape = list(out.shape)
        del out  # closes the map before the file is hashed and renamed
        _fsync_file(data_path)
        meta = {"format": FORMAT, "key": key.as_dict(), "shape": shape, "dtype": chunks.dtype.str,
                "sha256": file_sha256(data_path), "num_items": chunks.num_items,
                "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "fedguide_version": _fedguide_version()}
        meta_path = tmp / META_FILE
        meta_path.write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
        _fsync_file(meta_path)
        _fsync_dir(tmp)

    def _install(self, tmp: Path, final: Path, key: FeatureKey, num_items: int, dtype: np.dtype,
                 replace: bool) -> np.ndarray:
        aside = None
        if replace and (final.exists() or final.is_symlink()):
            aside = final.with_name(f".{final.name}.old-{uuid.uuid4().hex[:8]}")
            os.rename(final, aside)
        try:
            os.rename(tmp, final)
        except OSError:
            if aside is not None:
                os.rename(aside, final)  # put the previous version back before reporting
            shutil.rmtree(tmp, ignore_errors=True)
            if not replace and final.is_dir():
                # Another process finished this key first: use its cache (validated), drop ours.
                cached = self.open(key)
                if cached is not None:
                    self._check_request(key, cached, num_items, dtype)
                    return cached
            raise
        _fsync_dir(self.root)
        if aside is not None:
            _remove(aside)
        return np.load(final / DATA_FILE, mmap_mode="r", allow_pickle=False)
