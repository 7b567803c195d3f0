"""Digests that tell a file on disk from the one that was written: flipped bytes are found on load."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Optional

import torch

from fedguide.core.atomic import write_text


def tensors_sha256(tensors: dict[str, torch.Tensor]) -> str:
    """One digest over every tensor's name, dtype, shape and bytes, in name order."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b"")  # a view: no copy
    return digest.hexdigest()


def file_sha256(path: Path, chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file, read in ``chunk``-byte pieces so a large file never sits in memory whole."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def hash_cache_path() -> Path:
    """Where whole-file digests are remembered between processes ($FEDGUIDE_HASH_CACHE to move it)."""
    if os.environ.get("FEDGUIDE_HASH_CACHE"):
        return Path(os.environ["FEDGUIDE_HASH_CACHE"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser() / "fedguide" / "file_hashes.json"


def cached_file_sha256(path: Path, cache: Optional[Path] = None) -> str:
    """``file_sha256`` of a file, computed once per (path, size, mtime): a multi-GB weight file is read
    whole the first time and looked up afterwards. A file rewritten in place changes its mtime, so its
    digest is computed again. The remembered digests are a convenience: a cache that cannot be read
    or written is ignored."""
    path = Path(path).resolve()
    cache = cache or hash_cache_path()
    st = path.stat()
    stamp = [st.st_size, st.st_mtime_ns]
    try:
        known = json.loads(cache.read_text())
    except (OSError, ValueError):
        known = {}
    entry = known.get(str(path)) if isinstance(known, dict) else None
    if isinstance(entry, dict) and entry.get("stamp") == stamp and isinstance(entry.get("sha256"), str):
        return entry["sha256"]
    digest = file_sha256(path)
    known = known if isinstance(known, dict) else {}
    known[str(path)] = {"stamp": stamp, "sha256": digest}
    try:
        write_text(cache, json.dumps(known, sort_keys=True))
    except OSError:
        pass
    return digest
