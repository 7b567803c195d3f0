"""Assembling report.md and choosing where a report goes."""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterable

from fedguide.report.plots import ACCURACY_PNG, make_plots, partition_plan
from fedguide.report.runs import RunRecord, load_run
from fedguide.report.tables import _cell, domain_table, results_table

REPORT_MD = "report.md"


@dataclass
class ReportResult:
    out_dir: Path
    markdown_path: Path
    plot_paths: list[Path]
    markdown: str
    runs: list[RunRecord] = field(default_factory=list)

    @property
    def paths(self) -> list[Path]:
        return [self.markdown_path, *self.plot_paths]


def default_out_dir(run_paths: list[Path], now: datetime | None = None) -> Path:
    """One run: its own plots/ (the report belongs to it). Several: a fresh report-<timestamp>/
    beside the first run, so reports over different run sets never overwrite each other."""
    if len(run_paths) == 1:
        return run_paths[0] / "plots"
    stamp = (now or datetime.now()).strftime("%Y%m%d-%H%M%S")
    base = run_paths[0].resolve().parent / f"report-{stamp}"
    candidate, i = base, 2
    while candidate.exists():  # two reports within the same second
        candidate, i = base.with_name(f"{base.name}-{i}"), i + 1
    return candidate


def _write_text_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; a report is meant to be shared
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _rel(path: Path, start: Path) -> str:
    try:
        return os.path.relpath(path.resolve(), start.resolve())
    except ValueError:  # different drives on Windows
        return str(path.resolve())


def render_markdown(runs: list[RunRecord], out_dir: Path, plots: Iterable[Path] = ()) -> str:
    plots = list(plots)  # read twice below
    n_done = sum(r.complete for r in runs)
    lines = [
        "# fedguide report",
        "",
        f"Generated {datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M:%S UTC')} from {len(runs)} run(s): "
        f"{n_done} complete, {len(runs) - n_done} incomplete.",
        "",
        "## Results",
        "",
        results_table(runs),
        *(["## Per-domain test accuracy (final round)", "", domains, ""] if (domains := domain_table(runs)) else []),
        "## Test accuracy",
        "",
        f"![test accuracy per round]({ACCURACY_PNG})",
        "",
    ]
    plan = partition_plan(runs)
    if plan:
        lines += ["## Partitions", ""]
        for stem, members in plan:
            names = ", ".join(r.name for r in members)
            lines += [f"**{members[0].partition_label}** on {members[0].dataset} (runs: {names})", "",
                      f"![partition {members[0].partition_label}]({stem}.png)", ""]
            if any(p.name == f"{stem}_domains.png" for p in plots):
                lines += [f"![domains {members[0].partition_label}]({stem}_domains.png)", ""]

    # Only this report's plots: an earlier report in the same folder may have left other files.
    dw = sorted(p for p in plots if p.name.startswith("feddw_"))
    if dw:
        lines += ["## FedDW: soft labels vs classification-layer relations", ""]
        lines += [f"![{p.stem}]({p.name})" for p in dw] + [""]
    lines += ["## Runs", "", "| run | method | seed | status | git commit | path |", "|---|---|---:|---|---|---|"]
    for r in runs:
        status = r.status
        commit = (r.git_commit or "n/a")[:12]
        lines.append("| " + " | ".join(_cell(c) for c in
                                         (r.name, r.method, r.seed, status, commit, _rel(r.path, out_dir))) + " |")
    notes = [w for r in runs for w in r.warnings]
    if notes:
        lines += ["", "> **Warnings:**"] + [f"> - {w}" for w in notes]
    commits = {r.git_commit for r in runs if r.git_commit}
    if len(commits) > 1:
        # Results from different code versions may not be comparable; make that visible.
        lines += ["", f"> **Note:** these runs come from {len(commits)} different git commits."]
    return "\n".join(lines) + "\n"


def report(paths: Iterable[str | Path], out: str | Path | None = None) -> ReportResult:
    """Load run directories, write report.md plus PNGs into ``out`` and return what was written."""
    run_paths = [Path(p) for p in paths]
    if not run_paths:
        raise ValueError("report() needs at least one run directory")
    # Dedupe so the same run passed twice (e.g. via a shell glob and by name) is not counted as two seeds.
    unique: dict[Path, Path] = {}
    for p in run_paths:
        unique.setdefault(p.resolve(), p)
    run_paths = list(unique.values())
    runs = [load_run(p) for p in run_paths]

    out_dir = Path(out) if out is not None else default_out_dir(run_paths)
    out_dir.mkdir(parents=True, exist_ok=True)
    plot_paths = make_plots(runs, out_dir)
    markdown = render_markdown(runs, out_dir, plot_paths)
    md_path = out_dir / REPORT_MD
    _write_text_atomic(md_path, markdown)
    return ReportResult(out_dir=out_dir, markdown_path=md_path, plot_paths=plot_paths, markdown=markdown, runs=runs)
