"""An exclusive lock on a run folder for the life of a run, so two processes never write one run.

``fcntl.flock`` on ``<run>/.lock``: the kernel releases it when the holder exits, however it exits
(SIGKILL included), so a crashed run never leaves a stale lock behind. The file holds the holder's
pid for the message a second process gets; it is never deleted (deleting a lock file that another
process has open lets two processes hold "the" lock on different files). It is opened without following
a symbolic link and refused unless it is a regular file: a ``.lock`` linked elsewhere would otherwise have
the file it points to truncated and overwritten with a pid.
"""
from __future__ import annotations

import fcntl
import os
import stat
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
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o666)
        except OSError as err:  # ELOOP: a symbolic link; others: a folder, a file not ours to write
            raise self._refused(f"it cannot be opened as a lock file ({err.strerror})") from None
        kind = os.fstat(fd).st_mode
        if not stat.S_ISREG(kind):  # a FIFO or a device: never written to
            os.close(fd)
            raise self._refused("it is not a regular file")
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

    def _refused(self, why: str) -> ConfigError:
        return ConfigError(f"{self.path} is not a lock file fedguide wrote: {why}. fedguide writes only a regular "
                           f"file there; remove it (rm {self.path}) and run the command again")

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None
