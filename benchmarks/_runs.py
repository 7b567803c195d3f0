"""What the benchmark suites share: runs through the CLI (kept, resumed or started), their records, and
the mean ± std cells of their tables."""
from __future__ import annotations

import json
import signal
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

REPO = Path(__file__).resolve().parents[1]
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


def ensure_run(config: Path | str, out: Path, overrides: list[str], quiet: bool = True) -> Path:
    """The finished run in ``out``: kept when it has its summary.json, continued with ``fedguide resume``
    when it was started (its config.yaml is there: checkpoints, or a one-shot method's finished clients,
    are picked up), else started with ``overrides``."""
    if not (out / "summary.json").exists():
        flags = ["--quiet"] if quiet else []
        if (out / "config.yaml").is_file():
            cli("resume", out, *flags)
        else:
            cli("run", config, *flags, "--out", out, *overrides)
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
