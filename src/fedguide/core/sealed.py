"""Sealed safetensors files: every tensor and every metadata entry is covered by a digest checked on read.

A sealed file's metadata holds, beside the writer's own entries,

    sha256            the tensors' digest (``tensors_sha256``: names, dtypes, shapes, bytes)
    metadata_sha256   the digest of every other metadata entry (``sha256`` included), keys and values

so a flipped byte anywhere (a tensor, a digit of a metrics history in the header, a key's name) is found
on read. A file that lacks a digest it should carry (a key renamed or removed) is refused as well, never
read unverified. Each kind of file says which files written before sealing it still reads, and how
(``legacy``): those are read once with a warning, and written sealed from then on.

The metadata check needs no torch (``read_metadata``), so a report can trust a checkpoint's pinned config
without importing it.
"""
from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

from fedguide.core.atomic import write_atomic

if TYPE_CHECKING:
    import torch

TENSORS_DIGEST = "sha256"
METADATA_DIGEST = "metadata_sha256"
DIGESTS = (TENSORS_DIGEST, METADATA_DIGEST)


class Unverified(ValueError):
    """A sealed file that cannot be trusted; ``reason`` says why, for the caller's own sentence."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def metadata_sha256(metadata: dict[str, str]) -> str:
    body = {k: v for k, v in metadata.items() if k != METADATA_DIGEST}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def seal(tensors: "dict[str, torch.Tensor]", metadata: Optional[dict[str, str]] = None) -> dict[str, str]:
    from fedguide.core.checksums import tensors_sha256

    clash = set(DIGESTS) & set(metadata or {})
    if clash:
        raise ValueError(f"metadata entries {sorted(clash)} are the seal's own")
    sealed = {**(metadata or {}), TENSORS_DIGEST: tensors_sha256(tensors)}
    sealed[METADATA_DIGEST] = metadata_sha256(sealed)
    return sealed


def save_sealed(path: Path, tensors: "dict[str, torch.Tensor]", metadata: Optional[dict[str, str]] = None) -> None:
    """``tensors`` and ``metadata`` as one sealed safetensors file, written atomically."""
    from safetensors.torch import save_file

    sealed = seal(tensors, metadata)
    write_atomic(Path(path), lambda tmp: save_file(tensors, tmp, metadata=sealed))


@dataclass
class Opened:
    tensors: "dict[str, torch.Tensor]"
    metadata: dict[str, str]  # the writer's entries, without the digests
    legacy: bool = False  # written before this kind of file was sealed: its metadata is unverified


Legacy = Callable[[dict[str, str]], bool]  # whether unsealed metadata is that of an older, accepted file


def check_metadata(metadata: dict[str, str], keys: frozenset[str], legacy: Optional[Legacy] = None) -> bool:
    """Whether ``metadata`` is sealed and intact (False) or an accepted older file's (True); else Unverified.
    ``keys``: the writer's entries a sealed file may hold."""
    unknown = sorted(set(metadata) - set(keys) - set(DIGESTS))
    if METADATA_DIGEST in metadata:
        if metadata_sha256(metadata) != metadata[METADATA_DIGEST]:
            raise Unverified("its metadata does not match the sha256 stored with it (bytes changed on disk)")
        if unknown or TENSORS_DIGEST not in metadata:
            raise Unverified(f"its metadata holds unexpected entries {unknown or ['no ' + TENSORS_DIGEST]}")
        return False
    if legacy is not None and not unknown and legacy(metadata):
        return True
    missing = f"no {METADATA_DIGEST}" if TENSORS_DIGEST in metadata else "no checksum"
    named = f" (unknown entries {unknown}: a checksum's key may have been renamed)" if unknown else ""
    raise Unverified(f"it carries {missing}{named}, so it cannot be verified")


def load_sealed(path: Path, keys: frozenset[str], legacy: Optional[Legacy] = None) -> Opened:
    """The sealed file at ``path``, verified; Unverified when it is unreadable, altered or unsealed (bar the
    older files ``legacy`` accepts, whose tensors are still checked when they carry a digest)."""
    from safetensors import SafetensorError, safe_open

    from fedguide.core.checksums import tensors_sha256

    try:
        with safe_open(str(path), framework="pt") as fh:
            metadata = dict(fh.metadata() or {})
            tensors = {k: fh.get_tensor(k) for k in fh.keys()}
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        raise Unverified(f"it cannot be read ({type(err).__name__}: {err})") from None
    is_legacy = check_metadata(metadata, keys, legacy)
    if TENSORS_DIGEST in metadata and tensors_sha256(tensors) != metadata[TENSORS_DIGEST]:
        raise Unverified("its tensors do not match the sha256 stored with them (bytes changed on disk)")
    return Opened(tensors, {k: v for k, v in metadata.items() if k not in DIGESTS}, is_legacy)


def read_metadata(path: Path, keys: frozenset[str], legacy: Optional[Legacy] = None) -> tuple[dict[str, str], bool]:
    """(metadata without the digests, legacy) of a sealed file, its metadata verified and its tensors not read:
    the safetensors header alone (an 8-byte length, then JSON), so no torch is imported."""
    try:
        with open(path, "rb") as fh:
            (size,) = struct.unpack("<Q", fh.read(8))
            if size > 100 << 20:
                raise ValueError(f"a header of {size} bytes")
            header = json.loads(fh.read(size))
        metadata = header.get("__metadata__") or {}
        if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
            raise ValueError("metadata is not a mapping of strings")
    except (OSError, ValueError, struct.error, AttributeError) as err:
        raise Unverified(f"it cannot be read ({type(err).__name__}: {err})") from None
    is_legacy = check_metadata(metadata, keys, legacy)
    return {k: v for k, v in metadata.items() if k not in DIGESTS}, is_legacy
