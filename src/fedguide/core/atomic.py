"""Atomic file writes: write a sibling temp file, fsync, then rename over the target.

A crash mid-write leaves the previous version intact, never a truncated file.
"""
from __future__ import annotations

import errno
import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any, Callable


def _umask() -> int:
    try:  # Linux reports it without changing it (threads may be creating files meanwhile)
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)  # elsewhere, reading it means setting it: set it straight back
    os.umask(mask)
    return mask


TMP_SUFFIX = ".tmp"  # temporaries are ``.<name>.<random>.tmp`` beside their target


def write_atomic(path: Path, writer: Callable[[str], None]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=TMP_SUFFIX, dir=path.parent)
    os.close(fd)
    try:
        try:
            writer(tmp)
        except Exception as err:  # noqa: BLE001 — only a disk's error is translated, the rest re-raised
            failed = _disk_error(err)
            if failed is None:
                raise
            raise OSError(failed, os.strerror(failed), str(path)) from None
        # mkstemp makes the file 0600 (and some writers, safetensors' among them, create the file anew): a run
        # folder is shared like any other output, so the user's umask decides, whoever wrote the bytes.
        os.chmod(tmp, 0o666 & ~_umask())
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _disk_error(err: Exception) -> int | None:
    """The errno of a write the disk refused (full, over quota, too large), also when the writer (safetensors)
    reports it as its own error type; None for any other error."""
    if isinstance(err, OSError):
        number = err.errno
    elif type(err).__name__ == "SafetensorError":
        found = re.search(r"os error (\d+)", str(err))
        number = int(found.group(1)) if found else None
    else:
        return None
    return number if number in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO) else None


def remove_stale_temporaries(folder: Path) -> None:
    """The temporaries writes killed mid-way left under ``folder``; the files they were meant to replace
    are intact."""
    for tmp in Path(folder).rglob(f".*{TMP_SUFFIX}"):
        if tmp.is_file():
            tmp.unlink()


def write_text(path: Path, text: str) -> None:
    def writer(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)

    write_atomic(path, writer)


def write_json(path: Path, obj: Any) -> None:
    write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def write_jsonl(path: Path, rows: list[dict]) -> None:
    write_text(path, "".join(json.dumps(r) + "\n" for r in rows))
