"""Finished pieces of a feature extraction in progress, so that an interrupted one resumes where it stopped.

The FeatureStore computes a cache's items in chunks of consecutive items (a whole number of batches) and
writes each finished chunk here, beside the cache it is building::

    root/.<dataset>-<split>-<digest>.chunks/
        chunks.json                      # {format, key, num_items, batch_size, chunk_items, dtype}
        chunk-000000000000.safetensors   # items [0, chunk_items): tensor "features", metadata start/stop/sha256
        chunk-000000001024.safetensors   # ...

The folder is named after the cache it builds (same key, same digest), so a rerun of the same extraction
finds it; once the full features are cached it is removed.

Decisions
- Chunk boundaries are multiples of the batch size, so a resumed extraction calls the model on exactly
  the batches an uninterrupted one does, and its features are bit-identical.
- ``chunks.json`` pins what decides the chunks' contents and layout (key, item count, batch size, chunk
  size, dtype). A folder made for another layout is discarded, not mixed in.
- Each chunk is written atomically (a temporary file renamed into place) and carries the sha256 of its
  data; a chunk that fails to load, or whose checksum, range, dtype or key does not match, is dropped and
  computed again. A chunk that changes between that check and the final assembly is an error.
"""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any, Optional

import numpy as np

from fedguide.core.atomic import write_atomic, write_json

MANIFEST = "chunks.json"
FORMAT = 1
TENSOR = "features"


def _name(start: int) -> str:
    return f"chunk-{start:012d}.safetensors"


def _sha256(array: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()


class FeatureChunks:
    """The chunk folder of one cache being built: which chunks are done, their data, new ones."""

    def __init__(self, folder: Path, key: dict, num_items: int, batch_size: int, chunk_items: int,
                 dtype: np.dtype):
        self.folder = Path(folder)
        self.key, self.num_items, self.chunk_items, self.dtype = key, num_items, chunk_items, np.dtype(dtype)
        self.manifest = {"format": FORMAT, "key": key, "num_items": num_items, "batch_size": batch_size,
                         "chunk_items": chunk_items, "dtype": self.dtype.str}

    def ranges(self) -> list[tuple[int, int]]:
        return [(s, min(s + self.chunk_items, self.num_items)) for s in range(0, self.num_items, self.chunk_items)]

    def open(self) -> dict[int, tuple[int, ...]]:
        """Start or resume: {start: feature shape} of the valid finished chunks (the rest are deleted)."""
        if self._manifest() != self.manifest:
            self.discard()
        self.folder.mkdir(parents=True, exist_ok=True)
        if not (self.folder / MANIFEST).is_file():
            write_json(self.folder / MANIFEST, self.manifest)
        done = {}
        for start, stop in self.ranges():
            path = self.folder / _name(start)
            if path.is_file():
                data = self.load(start, stop)
                if data is None:
                    path.unlink(missing_ok=True)
                else:
                    done[start] = tuple(data.shape[1:])
        return done

    def _manifest(self) -> Optional[dict]:
        try:
            return json.loads((self.folder / MANIFEST).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            return None

    def load(self, start: int, stop: int) -> Optional[np.ndarray]:
        """The data of chunk [start, stop), None if it is absent or does not check out."""
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(self.folder / _name(start)), framework="np") as fh:
                meta: dict[str, Any] = fh.metadata() or {}
                data = fh.get_tensor(TENSOR)
        except (OSError, SafetensorError, KeyError, ValueError, TypeError):
            return None
        good = (meta.get("start") == str(start) and meta.get("stop") == str(stop)
                and meta.get("key") == json.dumps(self.key, sort_keys=True)
                and data.dtype == self.dtype and data.ndim >= 1 and data.shape[0] == stop - start
                and meta.get("sha256") == _sha256(data))
        return data if good else None

    def save(self, start: int, stop: int, data: np.ndarray) -> None:
        from safetensors.numpy import save_file

        data = np.ascontiguousarray(data)
        meta = {"start": str(start), "stop": str(stop), "key": json.dumps(self.key, sort_keys=True),
                "sha256": _sha256(data)}
        write_atomic(self.folder / _name(start), lambda tmp: save_file({TENSOR: data}, tmp, metadata=meta))

    def any_done(self) -> bool:
        return self.folder.is_dir() and any(self.folder.glob("chunk-*.safetensors"))

    def discard(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)
