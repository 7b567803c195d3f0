"""Disk-backed per-client state, so memory does not grow with the number of clients.

Writes made during round r go to ``pending-<r>/`` and become visible only when the engine commits
round r, after the round's checkpoint is safely on disk. A run killed mid-round therefore resumes
with every client's state exactly as it was at the last checkpoint.

A client's state is one sealed safetensors file (``core/sealed.py``): its tensors, and its other values as
JSON metadata, both under digests verified on every read. A flipped byte or a truncated file stops the run
naming the client and the file (it once loaded silently, and the divergence that followed blamed the
learning rate). State written before it was sealed (``tensors.safetensors`` beside a ``scalars.json``) is
read unverified with a warning, once per folder, and written sealed at the client's next round.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

from fedguide.core.sealed import Unverified, load_sealed, save_sealed
from fedguide.registry import ConfigError

State = dict[str, Any]  # tensors and JSON-able scalars
TENSORS = "tensors.safetensors"
LEGACY_SCALARS = "scalars.json"  # beside the tensors, before state files were sealed
KEYS = frozenset({"scalars"})


class DamagedState(ConfigError):
    """A client's state file cannot be trusted."""


class ClientStateStore:
    def __init__(self, root: Path):
        # Folders appear with the first write: a run whose method keeps no client state (or that is
        # refused before its first round) leaves none behind.
        self.root = Path(root)
        self.committed = self.root / "committed"
        self._warned_legacy = False

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
        save_sealed(folder / TENSORS, tensors, {"scalars": json.dumps(scalars)})

    def _read(self, folder: Path) -> State | None:
        path = folder / TENSORS
        if not path.is_file():
            return None
        legacy = (folder / LEGACY_SCALARS).is_file()
        try:
            opened = load_sealed(path, KEYS, (lambda meta: not meta) if legacy else None)
            state: State = json.loads((folder / LEGACY_SCALARS).read_text() if opened.legacy
                                      else opened.metadata["scalars"])
            if not isinstance(state, dict):
                raise Unverified(f"its scalars are a {type(state).__name__}, not a mapping")
        except Unverified as err:
            raise self._damaged(path, err.reason) from None
        except (OSError, ValueError, KeyError) as err:
            raise self._damaged(path, f"it cannot be read ({type(err).__name__}: {err})") from None
        if opened.legacy and not self._warned_legacy:
            self._warned_legacy = True
            print(f"warning: client state under {self.root} was written before state files were sealed; it is "
                  "read unverified and written sealed at each client's next round", file=sys.stderr)
        state.update(opened.tensors)
        return state

    def _damaged(self, path: Path, why: str) -> DamagedState:
        run = self.root.parent
        return DamagedState(
            f"damaged client state: {path} (client {path.parent.name}): {why}. The run cannot continue with it. "
            f"Restore the file from a backup, or start the run again: fedguide run {run / 'config.yaml'} "
            "--out NEW_FOLDER")

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
