"""What every dataset source yields: in-memory tensors, ready for batching by index."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from pydantic import BaseModel, ConfigDict

from fedguide.registry import Registry


@dataclass
class DatasetSplits:
    """Normalised float32 images [N, C, H, W] and int64 labels, held in memory for the whole run."""

    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    class_names: list[str]

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    @property
    def input_shape(self) -> tuple[int, int, int]:
        return tuple(self.train_x.shape[1:])  # type: ignore[return-value]


class SourceParams(BaseModel):
    """Keys of the ``data`` section that every source understands (a source may add its own)."""

    model_config = ConfigDict(extra="forbid")
    root: Optional[str] = None


DATASETS: Registry = Registry("dataset")


def normalise(images_uint8: torch.Tensor, mean: float, std: float) -> torch.Tensor:
    """uint8 [N,H,W] or [N,C,H,W] -> float32 [N,C,H,W], standardised once so batches are plain gathers."""
    x = images_uint8.to(torch.float32).div_(255.0)
    if x.dim() == 3:
        x = x.unsqueeze(1)
    return x.sub_(mean).div_(std).contiguous()


def candidate_roots(root: Optional[str], env_var: str, *defaults: str) -> list[Path]:
    """Where to look, in order: the config's data.root, the environment variable, system defaults."""
    import os

    out = []
    if root:
        out.append(Path(root).expanduser())
    if os.environ.get(env_var):
        out.append(Path(os.environ[env_var]).expanduser())
    out.extend(Path(d) for d in defaults)
    return out
