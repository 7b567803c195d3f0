"""Assembling report.md and choosing where a report goes."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterable, Optional

from fedguide.core.atomic import write_text
from fedguide.report.discover import find_run_dirs, is_run_dir
from fedguide.report.formats import EXTENSIONS, FORMATS, render
from fedguide.report.measures import check_metric
from fedguide.report.paired import paired_data
from fedguide.report.pivot import pivot_data
from fedguide.report.plots import ACCURACY_PNG, make_plots, partition_plan
from fedguide.report.runs import RunRecord, load_run
from fedguide.report.tables import _cell, domain_table, personal_table, results_data, rounds_to_table

REPORT_MD = "report.md"


@dataclass
class ReportOptions:
    """What a report shows beyond its defaults (``fedguide report``'s options)."""

    vs: Optional[str] = None  # reference method of the paired differences
    rows: Optional[str] = None  # pivot: the key down the rows (method, partition, dataset or a dotted key)
    cols: Optional[str] = None  # pivot: the key across the columns
    metric: str = "last_k"  # pivot cells: last_k, final, best or a personal one; --vs compares a personal one too
    fmt: str = "md"  # the printed table (the pivot, else the results table): md, csv or latex
    last_k: Optional[int] = None  # one window for every run instead of each run's own
    rounds_to: Optional[list[float]] = None  # accuracy marks instead of those the runs recorded
    keep_previous: bool = False  # a report written before into the same folder is kept as report-<its time>/

    def check(self) -> None:
        check_metric(self.metric)
        if self.fmt not in FORMATS:
            raise ValueError(f"unknown format '{self.fmt}'; choose one of {', '.join(FORMATS)}")
        if self.cols is not None and self.rows is None:
            raise ValueError("--cols needs --rows (e.g. --rows method --cols partition)")
        if self.last_k is not None and (self.last_k < 2 or self.last_k % 2):
            raise ValueError(f"--last-k {self.last_k} is not an even number >= 2 (accuracy under label skew "
                             "oscillates with period 2, so an odd window favours one phase); write e.g. --last-k 10")
        if self.rounds_to is not None and not all(0 < m <= 1 for m in self.rounds_to):
            raise ValueError(f"--rounds-to {self.rounds_to}: write accuracies as fractions in (0, 1], e.g. 0.2,0.3,0.4")


@dataclass
class ReportResult:
    out_dir: Path
    markdown_path: Path
    plot_paths: list[Path]
    markdown: str
    runs: list[RunRecord] = field(default_factory=list)
    table: str = ""  # the pivot (or, without one, the results table) in the format asked for
    table_path: Optional[Path] = None  # that table as a file (pivot.md/.csv/.tex, results.csv/.tex)
    paired: str = ""  # the --vs table in the format asked for, empty without --vs
    paired_path: Optional[Path] = None  # that table as a file (paired.csv/.tex) outside Markdown

    @property
    def paths(self) -> list[Path]:
        return [self.markdown_path, *([self.table_path] if self.table_path else []),
                *([self.paired_path] if self.paired_path else []), *self.plot_paths]


def default_out_dir(run_paths: list[Path], given: Path | None = None) -> Path:
    """One run: its own plots/ (the report belongs to it). Several: report/ in the folder ``given`` first when
    that is a folder of runs (a sweep's), else beside the first run. The same runs reported again replace
    their report (``keep_previous`` keeps the old one beside it)."""
    if len(run_paths) == 1:
        return run_paths[0] / "plots"
    home = given if given is not None and not is_run_dir(given) else run_paths[0].resolve().parent
    return home / "report"


def set_aside(out_dir: Path) -> Optional[Path]:
    """Move a report written before into ``out_dir`` to ``report-<its time>/`` beside it; where it went."""
    md = out_dir / REPORT_MD
    if not md.is_file():
        return None
    stamp = datetime.fromtimestamp(md.stat().st_mtime).strftime("%Y%m%d-%H%M%S")
    target, i = out_dir.with_name(f"{out_dir.name}-{stamp}"), 2
    while target.exists():
        target, i = out_dir.with_name(f"{out_dir.name}-{stamp}-{i}"), i + 1
    out_dir.rename(target)
    return target


def clear_report(out_dir: Path) -> None:
    """Remove what a previous report wrote into ``out_dir`` (its Markdown, tables and plots), so a plot the
    new runs no longer make does not stay behind looking current; other files are left alone."""
    if not out_dir.is_dir():
        return
    for path in out_dir.iterdir():
        if path.is_file() and (path.name == REPORT_MD or path.suffix in (".png", ".csv", ".tex")
                               or path.name in ("pivot.md", "results.md")):
            path.unlink()


def _rel(path: Path, start: Path) -> str:
    try:
        return os.path.relpath(path.resolve(), start.resolve())
    except ValueError:  # different drives on Windows
        return str(path.resolve())


def device_check_lines(runs: list[RunRecord]) -> list[str]:
    """The simulated device's check of the runs that ran on it (train.device: simulated), one row each."""
    checked = [(r, r.summary["device_check"]) for r in runs
               if r.summary is not None and isinstance(r.summary.get("device_check"), dict)]
    if not checked:
        return []
    lines = ["## Device check (train.device: simulated)", "",
             "| run | method | steps | host syncs / step | H2D bytes / step | host syncs | H2D bytes | mixes |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r, c in checked:
        lines.append("| " + " | ".join(_cell(v) for v in (
            r.name, r.method, c.get("steps"), f"{c.get('host_syncs_per_step', 0):.2f}",
            f"{c.get('h2d_bytes_per_step', 0):.0f}", c.get("host_syncs"), c.get("h2d_bytes"), c.get("mixes"))) + " |")
    sites = [(r, c["h2d_step_sites"]) for r, c in checked if c.get("h2d_step_sites")]
    if sites:  # a copy inside the steps is what a GPU pays for every step: say where it comes from
        lines += ["", "Where the steps' host-to-device bytes come from (the largest five lines of each run):", ""]
        for r, found in sites:
            lines += [f"- {r.name}: " + "; ".join(f"`{where}` {nbytes} B" for where, nbytes in found.items())]
    return lines + [""]


def render_markdown(runs: list[RunRecord], out_dir: Path, plots: Iterable[Path] = (),
                    options: ReportOptions | None = None, pivot: str = "", paired: str = "") -> str:
    plots = list(plots)  # read twice below
    opts = options or ReportOptions()
    n_done = sum(r.complete for r in runs)
    rounds_to = rounds_to_table(runs, opts.rounds_to)
    domains = domain_table(runs, opts.last_k)
    personal = personal_table(runs, opts.last_k)
    lines = [
        "# fedguide report",
        "",
        f"Generated {datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M:%S UTC')} from {len(runs)} run(s): "
        f"{n_done} complete, {len(runs) - n_done} incomplete.",
        "",
        "## Results",
        "",
        render(results_data(runs, opts.last_k), "md"),
        *([f"## Paired differences against {opts.vs}", "", paired, ""] if paired else []),
        *([f"## {opts.rows} × {opts.cols}" if opts.cols else f"## By {opts.rows}", "", pivot, ""] if pivot else []),
        *(["## Rounds to accuracy", "", rounds_to, ""] if rounds_to else []),
        *(["## Per-domain test accuracy (mean of the last k rounds)", "", domains, ""] if domains else []),
        *(["## Personalised test accuracy (mean of the last k rounds)", "", personal, ""] if personal else []),
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
    # The figures 'fedguide analyze' wrote into each run's analysis/ folder, where it has run.
    analysis = [(r, p) for r in runs for p in sorted((r.path / "analysis").glob("*.png"))]
    if analysis:
        lines += ["## Analysis figures (fedguide analyze)", ""]
        lines += [f"![{r.name}: {p.stem}]({_rel(p, out_dir)})" for r, p in analysis] + [""]
    lines += device_check_lines(runs)
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


def report(paths: Iterable[str | Path], out: str | Path | None = None, options: ReportOptions | None = None,
           **kwargs) -> ReportResult:
    """Load run folders (and the run folders below any other folder given), write report.md plus PNGs
    into ``out`` and return what was written. ``options`` (or its fields as keyword arguments: ``vs``,
    ``rows``, ``cols``, ``metric``, ``fmt``, ``last_k``, ``rounds_to``) add the paired differences and
    the pivot; a pivot, or a results table in CSV or LaTeX, is also written as a file of its own."""
    if options is not None and kwargs:
        raise TypeError(f"report() takes options or its fields as keywords, not both (got {', '.join(kwargs)})")
    opts = options or ReportOptions(**kwargs)
    opts.check()
    paths = list(paths)
    if not paths:
        raise ValueError("report() needs at least one run directory")
    run_paths = find_run_dirs(paths)
    runs = [load_run(p) for p in run_paths]
    # Computed before anything is written: a bad --vs or --rows leaves no half-made report folder.
    pivot = pivot_data(runs, opts.rows, opts.cols, opts.metric, opts.last_k) if opts.rows else None
    paired = paired_data(runs, opts.vs, opts.last_k, opts.metric) if opts.vs else None

    out_dir = Path(out) if out is not None else default_out_dir(run_paths, given=Path(paths[0]))
    if opts.keep_previous:
        set_aside(out_dir)
    clear_report(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    plot_paths = make_plots(runs, out_dir)
    markdown = render_markdown(runs, out_dir, plot_paths, opts, render(pivot, "md") if pivot else "",
                               render(paired, "md") if paired else "")
    md_path = out_dir / REPORT_MD
    write_text(md_path, markdown)
    table = render(pivot if pivot is not None else results_data(runs, opts.last_k), opts.fmt)
    table_path = None
    if pivot is not None or opts.fmt != "md":
        table_path = out_dir / f"{'pivot' if pivot is not None else 'results'}.{EXTENSIONS[opts.fmt]}"
        write_text(table_path, table)
    paired_text, paired_path = render(paired, opts.fmt) if paired else "", None
    if paired is not None and opts.fmt != "md":
        paired_path = out_dir / f"paired.{EXTENSIONS[opts.fmt]}"
        write_text(paired_path, paired_text)
    return ReportResult(out_dir=out_dir, markdown_path=md_path, plot_paths=plot_paths, markdown=markdown, runs=runs,
                        table=table, table_path=table_path, paired=paired_text, paired_path=paired_path)
