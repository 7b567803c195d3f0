"""What a run keeps in its ``.<name>.partial`` folder until the models are written: the training log
and the finished stages (and UNet checkpoints), each tagged with the settings it was made with, so a
killed run started again reuses exactly the stages those settings still describe.

A stage file is a safetensors file: its tensors, and everything else (the settings key, step counts,
optimiser hyper-parameters) as JSON in the file's metadata. Nothing in that folder is ever unpickled,
so a file someone else put there can at worst be refused, never run. A stage file is sealed
(``core/sealed.py``): its tensors and its metadata are verified on every read, so a flipped byte is
refused, never trained on. A stage file written before stage files were sealed is not reused: its stage
is trained again (it is a cache of an interrupted run, so nothing but time is lost), with a line saying so.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from fedguide.core.sealed import Unverified, load_sealed, save_sealed

FORMAT = "fedguide-pretrain-stage"  # the metadata entry holding the JSON part


class Log:
    def __init__(self, path: Path, quiet: bool):
        self.path, self.quiet, self.start = path, quiet, time.perf_counter()
        # A resumed run's card keeps the lines of the runs that trained its reused stages.
        self.rows: list[dict] = ([json.loads(line) for line in path.read_text().splitlines() if line.strip()]
                                 if path.is_file() else [])

    def __call__(self, stage: str, **row) -> None:
        row = {"stage": stage, "seconds": round(time.perf_counter() - self.start, 1), **row}
        self.append(row)
        if not self.quiet and row.get("final"):
            print(f"{stage}: " + ", ".join(f"{k}={v}" for k, v in row.items() if k not in ("stage", "final")),
                  file=sys.stderr, flush=True)

    def append(self, row: dict) -> None:
        """A row as it is (another run's line keeps its own elapsed seconds)."""
        self.rows.append(row)
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")


def stage_file(partial: Path, name: str) -> Path:
    return partial / f"{name}.safetensors"


def _pack(obj, tensors: dict):
    """``obj`` as JSON, each tensor replaced by its name in ``tensors`` (tuples and non-string keys kept)."""
    if isinstance(obj, torch.Tensor):
        name = str(len(tensors))
        tensors[name] = obj.detach().contiguous()
        # The memory layout too: a channels-last latent gives other (equally valid) float results than a
        # contiguous one, and a resumed run must repeat the uninterrupted run's numbers exactly.
        return {"tensor": name} if obj.is_contiguous() else {"tensor": name, "stride": list(obj.stride())}
    if isinstance(obj, np.generic):  # e.g. the learning rates LambdaLR computes with numpy
        return {"numpy": [obj.dtype.str, obj.item()]}
    if isinstance(obj, dict):
        return {"dict": [[_pack(k, tensors), _pack(v, tensors)] for k, v in obj.items()]}
    if isinstance(obj, (list, tuple)):
        return {type(obj).__name__: [_pack(v, tensors) for v in obj]}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return {"value": obj}
    raise TypeError(f"a pretraining stage cannot hold a {type(obj).__name__}")


def _tensor(stored: torch.Tensor, stride: Optional[list]) -> torch.Tensor:
    if stride is None:
        return stored
    return torch.empty_strided(stored.shape, stride, dtype=stored.dtype).copy_(stored)


def _unpack(node, tensors: dict):
    kind, value = next(iter(node.items()))
    if kind == "tensor":
        return _tensor(tensors[value], node.get("stride"))
    if kind == "numpy":
        return np.dtype(value[0]).type(value[1])
    if kind == "dict":
        return {_unpack(k, tensors): _unpack(v, tensors) for k, v in value}
    if kind in ("list", "tuple"):
        items = [_unpack(v, tensors) for v in value]
        return items if kind == "list" else tuple(items)
    if kind == "value":
        return value
    raise ValueError(f"unknown entry {kind!r}")


def save_atomic(obj: dict, path: Path) -> None:
    """``obj`` (tensors, dicts, lists, tuples, numbers, strings) as a safetensors file; a kill mid-save
    leaves the previous stage file or checkpoint, not a truncated one."""
    tensors: dict[str, torch.Tensor] = {}
    meta = {FORMAT: json.dumps(_pack(obj, tensors))}
    save_sealed(path, tensors, meta)


def read_stage(path: Path) -> Optional[dict]:
    """The stage file at ``path`` whatever settings made it (``load_stage`` checks them), verified; None for one
    written before stage files were sealed (its stage is trained again). A file that is not an intact stage
    file (damaged, or not one at all: a pickle, say) is refused with a ValueError, never executed."""
    fix = "it was not loaded: delete it (or its folder) to retrain that stage"
    try:
        opened = load_sealed(path, frozenset({FORMAT}), lambda meta: set(meta) == {FORMAT})
    except Unverified as err:
        raise ValueError(f"{path} is not a stage file written by fedguide pretrain-guidance, or not intact "
                         f"({err.reason}); {fix}") from None
    if opened.legacy:
        print(f"{path} was written before stage files carried a checksum: not reused, its stage is trained again",
              file=sys.stderr, flush=True)
        return None
    try:
        return _unpack(json.loads(opened.metadata[FORMAT]), opened.tensors)
    except Exception as err:  # noqa: BLE001 — whatever is wrong with it, it is not loaded
        raise ValueError(f"{path} is not a stage file written by fedguide pretrain-guidance ({type(err).__name__}: "
                         f"{err}); {fix}") from None


def load_stage(path: Path, key: dict):
    """The saved stage at ``path`` if it was made with ``key`` (see settings.stage_key), else None. A file
    that is not such a stage (a pickle, say) is refused with a ValueError, never executed."""
    if not path.is_file():
        return None
    state = read_stage(path)
    return state if isinstance(state, dict) and state.get("key") == key else None
