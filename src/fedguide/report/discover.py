"""Which folders a report covers: run folders given directly, and the run folders found below any other
folder given (a sweep's parent folder, a folder of several sweeps).

A run folder is one holding config.yaml; the search does not descend into one (its plots/, checkpoints/
and guidance/ hold no runs) and passes over the rest, so the report folders a sweep writes beside its
runs (report.md and PNGs, no config.yaml) are neither runs nor errors.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable

from fedguide.fl.run_folder import CONFIG_FILE, METRICS_FILE, STOPPED_FILE, SUMMARY_FILE

RUN_MARKERS = (CONFIG_FILE, METRICS_FILE, SUMMARY_FILE, STOPPED_FILE)


def is_run_dir(path: Path) -> bool:
    return path.is_dir() and any((path / name).is_file() for name in RUN_MARKERS)


def _runs_below(root: Path) -> list[Path]:
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):  # symbolic links to folders are not followed
        if CONFIG_FILE in filenames:
            found.append(Path(dirpath))
            dirnames.clear()
            continue
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
    return found


def find_run_dirs(paths: Iterable[str | Path]) -> list[Path]:
    """Run folders of ``paths`` in the order given (those below a folder sorted by path), each once."""
    found: dict[Path, Path] = {}
    for p in map(Path, paths):
        if not p.is_dir():
            raise ValueError(f"{p} is not a directory; pass run folders or folders holding them (a sweep's --out)")
        runs = [p] if is_run_dir(p) else _runs_below(p)
        if not runs:
            raise ValueError(f"{p} holds no run folder (no {CONFIG_FILE} in it or below it); pass run folders or "
                             "a folder holding them, such as a sweep's --out")
        for r in runs:
            # The same run reached twice (a glob and its parent folder) is one run, not two seeds.
            found.setdefault(r.resolve(), r)
    return list(found.values())
