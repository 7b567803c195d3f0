"""An exclusive lock on a run folder for the life of a run, so two processes never write one run.

``fcntl.flock`` on ``<run>/.lock``: the kernel releases it when the holder exits, however it exits
(SIGKILL included), so a crashed run never leaves a stale lock behind. The file holds the holder's
pid for the message a second process gets; it is never deleted (deleting a lock file that another
process has open lets two processes hold "the" lock on different files).
"""
from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import Optional

from fedguide.registry import ConfigError

LOCK_FILE = ".lock"


class RunFolderBusy(ConfigError):
    """Another process holds the run folder."""


class RunLock:
    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / LOCK_FILE
        self._fd: Optional[int] = None

    def __enter__(self) -> "RunLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 64).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise RunFolderBusy(f"{self.path.parent} is in use by another fedguide process (pid {holder}); wait "
                                "for it to end, or choose another --out") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None
