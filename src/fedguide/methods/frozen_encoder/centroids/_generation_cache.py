"""What a one-shot server's generation has produced so far, batch by batch, in the run directory, so that a
run stopped in the middle of a long generation resumes after its last finished batch instead of from the
first image.

A batch's entry holds what the method keeps of it (for FedDISC: the image features and the few images
shown in the samples grid, as 8-bit pixels) under a key computed from everything its images depend on
(conditions, prompt, sampler settings, seed). An entry whose key differs, from a changed recipe or other
uploads, is never read: the batch is generated again and the entry replaced. Entries are sealed
(core/sealed.py: a flipped byte is found and the batch generated again) and written atomically, so a stop
during a write leaves the previous state. The folder is removed once the method has written its results.
"""
from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path
from typing import Any, Optional

import torch

from fedguide.core.sealed import Unverified, load_sealed, save_sealed

KEY = "key"


def batch_key(recipe: dict[str, Any], tensors: dict[str, Optional[torch.Tensor]]) -> str:
    """A digest of a batch's settings and of the exact values of the tensors that condition it."""
    h = hashlib.sha256(json.dumps(recipe, sort_keys=True, default=str).encode())
    for name in sorted(tensors):
        t = tensors[name]
        h.update(name.encode())
        if t is not None:
            c = t.detach().to("cpu", torch.float32).contiguous()
            h.update(str(tuple(c.shape)).encode())
            h.update(c.numpy().tobytes())
    return h.hexdigest()


class GenerationCache:
    def __init__(self, folder: Path):
        self.folder = folder

    def path(self, *index: int) -> Path:
        return self.folder / ("batch_" + "_".join(f"{i:05d}" for i in index) + ".safetensors")

    def load(self, index: tuple[int, ...], key: str) -> Optional[dict[str, torch.Tensor]]:
        """The entry at ``index`` if it was written under ``key`` and verifies against its digests, else None
        (the batch is generated again; a damaged entry is said)."""
        path = self.path(*index)
        if not path.is_file():
            return None
        try:
            opened = load_sealed(path, frozenset({KEY}))
        except Unverified as err:
            print(f"generation: {path} cannot be trusted ({err.reason}); generating the batch again",
                  file=sys.stderr)
            return None
        return opened.tensors if opened.metadata.get(KEY) == key else None

    def save(self, index: tuple[int, ...], key: str, tensors: dict[str, torch.Tensor]) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        plain = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
        save_sealed(self.path(*index), plain, {KEY: key})

    def remove(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)
