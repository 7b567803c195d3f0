"""PNG figures for a report.

Figures are built as ``matplotlib.figure.Figure`` objects drawn by the Agg canvas rather than through
pyplot: that never switches the process-wide backend (the caller may be a notebook or a GUI) and
leaves nothing registered in pyplot's figure manager, so there is no figure to leak or close.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

import numpy as np

from fedguide.core.atomic import write_atomic
from fedguide.report.feddw import plot_dw_matrices
from fedguide.report.runs import RunRecord, Runs, load_runs
from fedguide.report.tables import Group, group_runs

if TYPE_CHECKING:
    from matplotlib.figure import Figure

ACCURACY_PNG = "accuracy_curves.png"


def _new_figure(figsize: tuple[float, float]) -> Figure:
    # matplotlib here, not at the top: importing the API (a --dry-run, a run) must not import it, nor have it
    # create its configuration and cache folders, when no plot is drawn.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize, dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def save_atomic(fig: Figure, path: Path) -> Path:
    """Write via a temp file in the same directory and rename, so a reader (or a crash) never sees
    a half-written PNG and a rerun replaces the old file in one step; with the user's umask, as every file."""
    write_atomic(path, lambda tmp: fig.savefig(tmp, format="png"))
    return path


def _group_curve(group: Group) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Mean/min/max over seeds, on the rounds every seed evaluated (seeds of one group can differ
    when one was evaluated at a different cadence; interpolating would invent points)."""
    series = [dict(zip(*r.accuracy_series())) for r in group.runs]
    series = [s for s in series if s]
    if not series:
        empty = np.array([])
        return empty, empty, empty, empty
    common = sorted(set.intersection(*(set(s) for s in series)))
    acc = np.array([[s[x] for x in common] for s in series], dtype=float)
    return np.array(common), acc.mean(axis=0), acc.min(axis=0), acc.max(axis=0)


def plot_accuracy_curves(groups: list[Group], path: Path) -> Path:
    import matplotlib
    from matplotlib.ticker import MaxNLocator

    fig = _new_figure((8, 5))
    ax = fig.add_subplot()
    cmap = matplotlib.colormaps["tab10" if len(groups) <= 10 else "tab20"]
    # Distinguish datasets/partitions in the legend only when the plot actually mixes them.
    mixed = len({(g.dataset, g.partition) for g in groups}) > 1
    for i, g in enumerate(groups):
        x, mean, lo, hi = _group_curve(g)
        if x.size == 0:
            continue
        color = cmap(i % cmap.N)
        label = g.label + (f" — {g.dataset}, {g.partition}" if mixed else "")
        if g.complete:
            label += f" (n={len(g.runs)})"
        ax.plot(x, mean * 100, color=color, linestyle="-" if g.complete else "--", label=label,
                marker="o" if x.size == 1 else None)
        if len(g.runs) > 1:
            ax.fill_between(x, lo * 100, hi * 100, color=color, alpha=0.2, linewidth=0)
    ax.set_xlabel("round")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("test accuracy (%)")
    ax.set_title("Test accuracy per round (mean over seeds, band = min–max)")
    ax.grid(True, alpha=0.3)
    if ax.lines:
        ax.legend(fontsize="small", loc="best")
    return save_atomic(fig, path)


def _counts(run: RunRecord, key: str, what: str) -> np.ndarray:
    try:
        counts = np.array((run.partition or {})[key], dtype=float)
    except (KeyError, ValueError, TypeError) as err:
        raise ValueError(f"{run.path / 'partition.json'}: '{key}' must be a clients x {what} "
                         f"list of lists of numbers ({err})") from None
    if counts.ndim != 2 or counts.size == 0:
        raise ValueError(f"{run.path / 'partition.json'}: '{key}' must be a non-empty clients x {what} "
                         f"matrix, got shape {counts.shape}")
    return counts


def heatmap(counts: np.ndarray, names: Any, xlabel: str, title: str, path: Path) -> Path:
    """A clients x ``xlabel`` heatmap of ``counts`` (exact numbers on a small matrix), saved as ``path``."""
    n_clients, n_cols = counts.shape
    fig = _new_figure((max(6.0, min(16.0, 0.45 * n_cols + 3)), max(4.0, min(20.0, 0.28 * n_clients + 2))))
    ax = fig.add_subplot()
    im = ax.imshow(counts, aspect="auto", interpolation="nearest", cmap="viridis")
    fig.colorbar(im, ax=ax, label="samples")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("client")
    ax.set_title(title)
    if n_cols <= 40:
        ax.set_xticks(range(n_cols))
        if isinstance(names, list) and len(names) == n_cols:
            ax.set_xticklabels([str(n) for n in names], rotation=45, ha="right", fontsize="small")
    if n_clients <= 40:
        ax.set_yticks(range(n_clients))
    # Exact numbers help when the matrix is small enough to read them; beyond that they are noise.
    if n_clients * n_cols <= 200:
        thresh = counts.max() / 2 if counts.max() > 0 else 1
        for (ci, k), v in np.ndenumerate(counts):
            ax.text(k, ci, f"{v:g}", ha="center", va="center", fontsize="x-small",
                    color="black" if v > thresh else "white")
    return save_atomic(fig, path)


def plot_partition(run: RunRecord, path: Path) -> Path:
    """Class x client heatmap of a run's partition."""
    counts = _counts(run, "counts", "classes")
    n_clients, n_classes = counts.shape
    return heatmap(counts, (run.partition or {}).get("class_names"), "class",
                    f"Partition: {run.partition_label} on {run.dataset} ({n_clients} clients × {n_classes} classes)",
                    path)


def plot_domain_partition(run: RunRecord, path: Path) -> Path | None:
    """Domain x client heatmap, for data with domains (None otherwise)."""
    if "domain_counts" not in (run.partition or {}):
        return None
    counts = _counts(run, "domain_counts", "domains")
    n_clients, n_domains = counts.shape
    return heatmap(counts, run.partition.get("domain_names"), "domain",
                    f"Domains: {run.partition_label} on {run.dataset} ({n_clients} clients × {n_domains} domains)",
                    path)


def _safe_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._") or "run"


def partition_plan(runs: Iterable[RunRecord]) -> list[tuple[str, list[RunRecord]]]:
    """(file stem, runs sharing it) per distinct partition.json content, in first-seen order.

    Seeds of the same split usually share partition.json content, and one heatmap covers them all.
    """
    plan: dict[str, tuple[str, list[RunRecord]]] = {}
    used: set[str] = set()
    for run in runs:
        if run.partition is None:
            continue
        key = json.dumps(run.partition, sort_keys=True)
        if key not in plan:
            stem = base = f"partition_{_safe_name(run.name)}"
            i = 2
            while stem in used:  # different partitions from same-named dirs (e.g. a/seed0, b/seed0)
                stem, i = f"{base}-{i}", i + 1
            used.add(stem)
            plan[key] = (stem, [])
        plan[key][1].append(run)
    return list(plan.values())


def make_plots(runs: Runs, out_dir: str | Path) -> list[Path]:
    """Write accuracy_curves.png and one partition_<run-name>.png per distinct partition.json (plus
    partition_<run-name>_domains.png where the data has domains)."""
    runs = load_runs(runs)
    out_dir = Path(out_dir)
    written = [plot_accuracy_curves(group_runs(runs), out_dir / ACCURACY_PNG)]
    for stem, members in partition_plan(runs):
        written.append(plot_partition(members[0], out_dir / f"{stem}.png"))
        domains = plot_domain_partition(members[0], out_dir / f"{stem}_domains.png")
        if domains is not None:
            written.append(domains)
    for run in runs:
        png = plot_dw_matrices(run, out_dir / f"feddw_{_safe_name(run.name)}.png", save_atomic, _new_figure)
        if png is not None:
            written.append(png)
    return written
