"""One-file checkpoints: global weights, the method's server state and the run's progress.

Everything sits in a single safetensors file (progress as JSON metadata) written atomically, so a
checkpoint is either the old one or the new one, never a mix. The metadata also holds the run's
resolved config (the pin a resume is checked against). The file is sealed (``core/sealed.py``): a sha256
of the tensors and one of the metadata, the metrics history and the pinned config included, verified on
load: flipped bytes, a renamed checksum key or a truncated file are reported as a damaged checkpoint,
never trained on (nor reported: one flipped digit of a history once made an 18.42 % round the best 98.42 %).

A checkpoint written before its metadata was sealed (a tensor sha256, no metadata_sha256) is read once
with a warning: its tensors are verified, its metrics history is not; the next round's checkpoint is
sealed. One without any checksum is refused.
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from fedguide.core.sealed import TENSORS_DIGEST, Unverified, load_sealed, read_metadata, save_sealed
from fedguide.registry import ConfigError

if TYPE_CHECKING:
    import torch

FILE = "last.safetensors"
KEYS = frozenset({"progress", "config"})  # the metadata a checkpoint holds beside its digests


def _legacy(metadata: dict[str, str]) -> bool:
    """Written before checkpoints sealed their metadata: the tensors' sha256 alone."""
    return TENSORS_DIGEST in metadata and "progress" in metadata


class DamagedCheckpoint(ConfigError):
    """The checkpoint file cannot be trusted (unreadable, unsealed, or not matching its digests)."""


class CheckpointNotWritten(ConfigError):
    """Writing a checkpoint failed (a full disk): the previous checkpoint is intact."""


@dataclass
class Checkpoint:
    round: int
    global_weights: torch.Tensor
    method_state: dict[str, torch.Tensor] = field(default_factory=dict)
    metrics: list[dict[str, Any]] = field(default_factory=list)
    wall_seconds: float = 0.0
    config: Optional[dict[str, Any]] = None  # the resolved config the run was made with (without meta)
    notes: dict[str, Any] = field(default_factory=dict)  # e.g. rounds_raised_from: the run's history


def save_checkpoint(folder: Path, ckpt: Checkpoint) -> Path:
    # On the CPU, whatever device the run computes on: a run resumes on another device.
    tensors = {"global": ckpt.global_weights.cpu().contiguous()}
    tensors.update({f"method.{k}": v.cpu().contiguous() for k, v in ckpt.method_state.items()})
    meta = {"progress": json.dumps({"round": ckpt.round, "metrics": ckpt.metrics, "wall_seconds": ckpt.wall_seconds,
                                    "notes": ckpt.notes})}
    if ckpt.config is not None:
        meta["config"] = json.dumps(ckpt.config, sort_keys=True)
    path = Path(folder) / FILE
    try:
        save_sealed(path, tensors, meta)
    except OSError as err:  # write_atomic left the previous checkpoint in place
        run = path.parent.parent
        before = (f"the checkpoint of round {ckpt.round - 1} is intact and the run continues from it"
                  if ckpt.round > 1 else "the run starts again from round 1")
        raise CheckpointNotWritten(
            f"could not write the checkpoint of round {ckpt.round} ({err.strerror or err}: {err.filename or path}). "
            f"Nothing is lost: {before}. Free some space (or fix the cause), then continue with: "
            f"fedguide resume {run}") from None
    return path


def load_checkpoint(folder: Path) -> Checkpoint | None:
    path = Path(folder) / FILE
    if not path.is_file():
        return None
    try:
        opened = load_sealed(path, KEYS, _legacy)
    except Unverified as err:
        raise damaged(path, err.reason) from None
    meta, tensors = opened.metadata, opened.tensors
    try:
        progress = json.loads(meta["progress"])
        config = json.loads(meta["config"]) if "config" in meta else None
        ckpt = Checkpoint(progress["round"], tensors["global"],
                          {k[len("method."):]: v for k, v in tensors.items() if k.startswith("method.")},
                          progress["metrics"], progress["wall_seconds"], config, progress.get("notes", {}))
    except (ValueError, KeyError, TypeError) as err:
        raise damaged(path, f"it cannot be read ({type(err).__name__}: {err})") from None
    if opened.legacy:
        print(f"warning: {path} was written before checkpoints sealed their metadata: its tensors are verified, "
              "its metrics history and pinned config are not; the next checkpoint is sealed", file=sys.stderr)
    return ckpt


def read_pinned_config(folder: Path) -> Optional[dict[str, Any]]:
    """The config a checkpoint pins, its metadata verified, without reading its tensors (nor importing torch
    for them); None without a checkpoint or a pinned config. A DamagedCheckpoint when it cannot be trusted."""
    path = Path(folder) / FILE
    if not path.is_file():
        return None
    try:
        meta, _ = read_metadata(path, KEYS, _legacy)
        return json.loads(meta["config"]) if "config" in meta else None
    except Unverified as err:
        raise damaged(path, err.reason) from None
    except ValueError as err:
        raise damaged(path, f"its pinned config cannot be read ({err})") from None


def damaged(path: Path, why: str) -> DamagedCheckpoint:
    run = path.parent.parent
    return DamagedCheckpoint(
        f"damaged checkpoint: {path}: {why}. The run cannot continue from it. Restore the file from a backup, "
        f"or start the run again: fedguide run {run / 'config.yaml'} --out NEW_FOLDER")
