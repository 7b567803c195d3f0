"""Disk-backed per-client state, so memory does not grow with the number of clients.

Writes made during round r go to ``pending-<r>/`` and become visible only when the engine commits
round r, after the round's checkpoint is safely on disk. A run killed mid-round therefore resumes
with every client's state exactly as it was at the last checkpoint.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from fedguide.core.atomic import write_atomic, write_text

State = dict[str, Any]  # tensors and JSON-able scalars


class ClientStateStore:
    def __init__(self, root: Path):
        # Folders appear with the first write: a run whose method keeps no client state (or that is
        # refused before its first round) leaves none behind.
        self.root = Path(root)
        self.committed = self.root / "committed"

    def _pending(self, round_: int) -> Path:
        return self.root / f"pending-{round_}"

    def get(self, client_id: int, round_: int | None = None) -> State:
        """The client's state; within round r, its own pending write (if any) wins."""
        folders = ([self._pending(round_)] if round_ is not None else []) + [self.committed]
        for folder in folders:
            state = self._read(folder / str(client_id))
            if state is not None:
                return state
        return {}

    def put(self, client_id: int, round_: int, state: State) -> None:
        folder = self._pending(round_) / str(client_id)
        folder.mkdir(parents=True, exist_ok=True)
        # clone: safetensors refuses tensors that share storage (a view of another entry).
        # On the CPU: state on disk does not depend on the device that wrote it.
        tensors = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in state.items()
                   if isinstance(v, torch.Tensor)}
        scalars = {k: v for k, v in state.items() if not isinstance(v, torch.Tensor)}
        write_atomic(folder / "tensors.safetensors", lambda tmp: save_file(tensors, tmp))
        write_text(folder / "scalars.json", json.dumps(scalars))

    @staticmethod
    def _read(folder: Path) -> State | None:
        if not (folder / "scalars.json").is_file():
            return None
        state: State = json.loads((folder / "scalars.json").read_text())
        state.update(load_file(folder / "tensors.safetensors"))
        return state

    def commit(self, round_: int) -> None:
        pending = self._pending(round_)
        if not pending.is_dir():
            return
        self.committed.mkdir(parents=True, exist_ok=True)
        for folder in sorted(pending.iterdir()):
            target = self.committed / folder.name
            if target.exists():
                shutil.rmtree(target)
            os.replace(folder, target)
        shutil.rmtree(pending)

    def recover(self, checkpoint_round: int) -> None:
        """After a crash: finish commits the checkpoint covers, drop writes of unfinished rounds."""
        for pending in sorted(self.root.glob("pending-*"), key=lambda p: int(p.name.split("-")[1])):
            r = int(pending.name.split("-")[1])
            if r <= checkpoint_round:
                self.commit(r)
            else:
                shutil.rmtree(pending)

    def disk_bytes(self) -> int:
        return sum(f.stat().st_size for f in self.root.rglob("*") if f.is_file())
