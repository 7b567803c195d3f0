"""One-file checkpoints: global weights, the method's server state and the run's progress.

Everything sits in a single safetensors file (progress as JSON metadata) written atomically, so a
checkpoint is either the old one or the new one, never a mix.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from fedguide.core.atomic import write_atomic

FILE = "last.safetensors"


@dataclass
class Checkpoint:
    round: int
    global_weights: torch.Tensor
    method_state: dict[str, torch.Tensor] = field(default_factory=dict)
    metrics: list[dict[str, Any]] = field(default_factory=list)
    wall_seconds: float = 0.0


def save_checkpoint(folder: Path, ckpt: Checkpoint) -> Path:
    tensors = {"global": ckpt.global_weights.contiguous()}
    tensors.update({f"method.{k}": v.contiguous() for k, v in ckpt.method_state.items()})
    meta = {"progress": json.dumps({"round": ckpt.round, "metrics": ckpt.metrics, "wall_seconds": ckpt.wall_seconds})}
    path = Path(folder) / FILE
    write_atomic(path, lambda tmp: save_file(tensors, tmp, metadata=meta))
    return path


def load_checkpoint(folder: Path) -> Checkpoint | None:
    path = Path(folder) / FILE
    if not path.is_file():
        return None
    with safe_open(str(path), framework="pt") as fh:
        progress = json.loads(fh.metadata()["progress"])
        tensors = {k: fh.get_tensor(k) for k in fh.keys()}
    method_state = {k[len("method."):]: v for k, v in tensors.items() if k.startswith("method.")}
    return Checkpoint(progress["round"], tensors["global"], method_state, progress["metrics"], progress["wall_seconds"])
