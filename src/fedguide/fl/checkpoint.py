"""One-file checkpoints: global weights, the method's server state and the run's progress.

Everything sits in a single safetensors file (progress as JSON metadata) written atomically, so a
checkpoint is either the old one or the new one, never a mix. The metadata also holds the run's
resolved config (the pin a resume is checked against) and a sha256 of every tensor, verified on
load: flipped bytes or a truncated file are reported as a damaged checkpoint, never trained on.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from fedguide.core.atomic import write_atomic
from fedguide.core.checksums import tensors_sha256
from fedguide.registry import ConfigError

FILE = "last.safetensors"


class DamagedCheckpoint(ConfigError):
    """The checkpoint file cannot be trusted (unreadable, or its tensors do not match their sha256)."""


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
                                    "notes": ckpt.notes}),
            "sha256": tensors_sha256(tensors)}
    if ckpt.config is not None:
        meta["config"] = json.dumps(ckpt.config, sort_keys=True)
    path = Path(folder) / FILE
    write_atomic(path, lambda tmp: save_file(tensors, tmp, metadata=meta))
    return path


def load_checkpoint(folder: Path) -> Checkpoint | None:
    path = Path(folder) / FILE
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt") as fh:
            meta = fh.metadata() or {}
            tensors = {k: fh.get_tensor(k) for k in fh.keys()}
        progress = json.loads(meta["progress"])
        config = json.loads(meta["config"]) if "config" in meta else None
        ckpt = Checkpoint(progress["round"], tensors["global"],
                          {k[len("method."):]: v for k, v in tensors.items() if k.startswith("method.")},
                          progress["metrics"], progress["wall_seconds"], config, progress.get("notes", {}))
    except (SafetensorError, OSError, ValueError, KeyError, TypeError) as err:
        raise damaged(path, f"it cannot be read ({type(err).__name__}: {err})") from None
    # Checkpoints written before digests were stored have none: they load as they are.
    if "sha256" in meta and tensors_sha256(tensors) != meta["sha256"]:
        raise damaged(path, "its tensors do not match the sha256 stored with them (bytes changed on disk)")
    return ckpt


def damaged(path: Path, why: str) -> DamagedCheckpoint:
    run = path.parent.parent
    return DamagedCheckpoint(
        f"damaged checkpoint: {path}: {why}. The run cannot continue from it. Restore the file from a backup, "
        f"or start the run again: fedguide run {run / 'config.yaml'} --out NEW_FOLDER")
