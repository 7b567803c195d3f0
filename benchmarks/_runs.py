"""What the benchmark suites share: runs through the CLI (kept, resumed or started), their records, and
the mean ± std cells of their tables."""
from __future__ import annotations

import gzip
import hashlib
import json
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

from fedguide.core.atomic import write_atomic

REPO = Path(__file__).resolve().parents[1]
RUNS = REPO / "runs"
# A finished run's record, kept in the repository (benchmarks/results/records/<its path below runs/>): what a
# report reads, without checkpoints and weights, and the request it answered (config file, the hash of its
# content, the overrides). runs/ is not kept (a fresh clone has none), so a suite longer than one sitting would
# start again from nothing; with these it restores the runs it finished and goes on. partition.json (the scored
# test subset's indices) is kept gzipped.
RECORDS = REPO / "benchmarks" / "results" / "records"
RECORD_FILES = ("config.yaml", "partition.json", "metrics.jsonl", "summary.json")  # summary.json last
REQUEST_FILE = "request.json"
# An override that runs every method on its own defaults: a study that varies a method's options, or compares
# defaults, starts from them, not from what a config's method_options chose (demo.yaml's guidance weights).
FROM_DEFAULTS = ["method_options={}"]


def cli(*args: Any, capture: bool = False) -> str:
    """``fedguide`` with these arguments, from the repository root; its stdout when ``capture``.

    A suite stopped with SIGTERM (``kill <suite pid>``) passes it on and waits: the run stops as after
    Ctrl-C, resumable, instead of going on without its suite and holding its folder's lock. On Ctrl-C the
    terminal has signalled the run too, and the suite waits for it rather than killing it mid-round."""
    proc = subprocess.Popen([sys.executable, "-m", "fedguide.cli", *map(str, args)], cwd=REPO,
                            stdout=subprocess.PIPE if capture else None, text=True)
    stopped = []

    def forward(signum, frame):  # no waiting here: the interrupted communicate() holds Popen's wait lock
        stopped.append(signum)
        proc.send_signal(signum)

    previous = signal.signal(signal.SIGTERM, forward)  # suites call this from their main thread
    try:
        out, _ = proc.communicate()
    except KeyboardInterrupt:
        proc.wait()
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
    if stopped:
        raise SystemExit(128 + stopped[0])
    if proc.returncode:
        raise subprocess.CalledProcessError(proc.returncode, proc.args, out)
    return out if capture else ""


def record_of(out: Path) -> Optional[Path]:
    """Where the record of the run folder ``out`` is kept: None for a folder outside runs/."""
    out = Path(out).resolve()
    return RECORDS / out.relative_to(RUNS) if out.is_relative_to(RUNS) else None


def config_content_sha256(path: Path) -> str:
    """The hash of what a config file says, not of its bytes: its parsed YAML as canonical JSON, so a comment,
    a reordered key or a re-wrapped line is the same request and an edited value is another."""
    from fedguide.config import load_raw

    return hashlib.sha256(json.dumps(load_raw(path), sort_keys=True, default=str).encode()).hexdigest()


def request(config: Path | str, overrides: list[str]) -> dict[str, Any]:
    """What a run was asked for: a record answers a later request only if this is the same (an edited config
    value, or other overrides, mean another run; an edited comment does not)."""
    path = Path(config).resolve()
    return {"config": str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path),
            "config_content_sha256": config_content_sha256(path), "overrides": [str(o) for o in overrides]}


def _write_bytes(path: Path, data: bytes) -> None:
    # each file whole: an interrupted copy is never taken for a finished run (summary.json goes last)
    write_atomic(path, lambda tmp: Path(tmp).write_bytes(data))


def _stored(name: str) -> str:
    return name + ".gz" if name == "partition.json" else name


def _read_request(record: Path) -> Optional[dict[str, Any]]:
    try:
        return json.loads((record / REQUEST_FILE).read_text())
    except (OSError, ValueError):
        return None


def _same_file(a: Path, b: Path) -> bool:
    return b.is_file() and a.read_bytes() == b.read_bytes()


def keep_record(out: Path, asked: dict[str, Any]) -> None:
    """Write the finished run in ``out`` to its record (``record_of``) with the request ``asked``; a record of
    another request there is replaced. Nothing for a folder outside runs/ or an unfinished run."""
    record = record_of(out)
    if record is None or not (out / "summary.json").is_file():
        return
    (record / "summary.json").unlink(missing_ok=True)  # a half-replaced record is not a finished one
    for name in RECORD_FILES:
        stored = record / _stored(name)
        if (out / name).is_file():
            data = (out / name).read_bytes()
            # mtime 0: the same run gives the same bytes, so keeping it again is no change to commit
            _write_bytes(stored, gzip.compress(data, mtime=0) if stored.suffix == ".gz" else data)
        else:
            stored.unlink(missing_ok=True)
        if name == RECORD_FILES[-2]:  # the request before the summary: a summary always has its request
            _write_bytes(record / REQUEST_FILE, (json.dumps(asked, indent=1) + "\n").encode())


def restore_run(out: Path, asked: dict[str, Any]) -> bool:
    """Write ``out``'s kept record back into runs/ when it answers ``asked`` and ``out`` holds no run yet;
    whether it did. A record of another request is left alone (the run is made anew and replaces it)."""
    out = Path(out).resolve()
    record = record_of(out)
    if record is None or not (record / "summary.json").is_file():
        return False
    if (out / "summary.json").exists() or (out / "config.yaml").exists():
        return False
    if _read_request(record) != asked:
        print(f"{record.relative_to(REPO)}: kept for another request (config or overrides changed); "
              "running it anew", flush=True)
        return False
    for name in RECORD_FILES:
        stored = record / _stored(name)
        if stored.is_file():
            data = stored.read_bytes()
            _write_bytes(out / name, gzip.decompress(data) if stored.suffix == ".gz" else data)
    print(f"{out.relative_to(REPO)}: restored from its record", flush=True)
    return True


def other_settings(config: Path | str, out: Path, overrides: list[str]) -> Optional[str]:
    """Why the run ``out`` holds is not the one ``config`` with ``overrides`` resolves to today (the pinned
    settings of its config.yaml against the resolved request, as a sweep compares them, and train.rounds); None
    when it is, or when ``out`` holds no run. A config value edited since the run, or a method's default
    changed in the code, makes another run of the same request."""
    from fedguide.config import load_config
    from fedguide.fl.run_folder import RunFolder
    from fedguide.fl.setup import resolve
    from fedguide.registry import ConfigError

    folder = RunFolder(out)
    if not folder.holds_run():
        return None
    wanted = resolve(load_config(config, overrides))
    try:
        comparison = folder.compare(wanted, ("its run", "the request"))
    except (ConfigError, ValueError) as err:
        return f"its config.yaml cannot be read: {err}"
    if not comparison.same:
        return "; ".join(comparison.differences)
    if comparison.held_rounds != comparison.wanted_rounds:
        return f"train.rounds: {comparison.held_rounds} (its run) vs {comparison.wanted_rounds} (the request)"
    return None


def _set_aside(out: Path, why: str, restored: bool) -> None:
    """Clear ``out`` for the request's own run: a copy just restored from its record is dropped (the record
    stays until the new run replaces it); a run made here is kept beside it, renamed, never deleted."""
    if restored:
        shutil.rmtree(out)
        print(f"{out.relative_to(REPO) if out.is_relative_to(REPO) else out}: its record no longer matches the "
              f"request ({why}); running it anew", flush=True)
        return
    aside = out.with_name(f"{out.name}.replaced-{time.strftime('%Y%m%d-%H%M%S')}")
    out.rename(aside)
    print(f"{out}: not this request's run ({why}); kept as {aside.name}, running it anew", flush=True)


def ensure_run(config: Path | str, out: Path, overrides: list[str], quiet: bool = True,
               execute: bool = True) -> Path:
    """The finished run in ``out``: kept when it has its summary.json, restored from its record (see
    RECORDS) when that answers the same request, continued with ``fedguide resume`` when it was started (its
    config.yaml is there: checkpoints, or a one-shot method's finished clients, are picked up), else started
    with ``overrides``. A folder whose run does not resolve to the request's settings (``other_settings``) is
    set aside first, so a record is never re-labelled with a request its run did not answer. A finished run
    without a record gets one. ``execute`` False: restore only, run nothing (a suite's --report)."""
    out = Path(out).resolve()
    asked = request(config, overrides)
    restored = restore_run(out, asked)
    why = other_settings(config, out, overrides)
    if why is not None:
        _set_aside(out, why, restored)
        if not execute:
            return out
    made = execute and not (out / "summary.json").exists()
    if made:
        flags = ["--quiet"] if quiet else []
        if (out / "config.yaml").is_file():
            cli("resume", out, *flags)
        else:
            cli("run", config, *flags, "--out", out, *overrides)
    record = record_of(out)
    # the record follows the run in runs/: another request's record, or another run's (one made here because the
    # record's no longer resolved from its request, or a run put in its folder by hand), is replaced
    if record is not None and (out / "summary.json").is_file() and (
            made or _read_request(record) != asked or not _same_file(out / "summary.json", record / "summary.json")):
        keep_record(out, asked)
    return out


def summary(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "summary.json").read_text())


def metrics(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def seed_note(n: int, seeds: Optional[int] = None) -> str:
    """'' for a cell with every seed of its table (``seeds``; without it, with more than one run), else how
    many runs it has."""
    return f" ({n} seed{'s' if n > 1 else ''})" if (n < seeds if seeds else n == 1) else ""


def mean_std(values: list[float], seeds: Optional[int] = None) -> str:
    """Fractions as 'mean ± sample std' in percent, with ``seed_note``."""
    if not values:
        return "—"
    n = len(values)
    note = seed_note(n, seeds)
    if n == 1:
        return f"{100 * values[0]:.2f}{note}"
    return f"{100 * statistics.fmean(values):.2f} ± {100 * statistics.stdev(values):.2f}{note}"
