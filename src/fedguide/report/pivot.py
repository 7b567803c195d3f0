"""The papers' table shape: one setting down the rows, another across the columns, mean ± std over seeds.

    fedguide report runs/sweep --rows method --cols partition --format latex

Cells hold only runs that differ in their seed (the grouping of the results table): a setting that
varies but is neither the rows' nor the columns' key goes into the row label, so the pivot never
averages two settings. Per-domain and per-client columns follow where the runs report them.
"""
from __future__ import annotations

from typing import Any

from fedguide.config import flat_keys
from fedguide.report.formats import Stat, Table, bold_best, render
from fedguide.report.measures import METRIC_NAMES, check_metric, common_k, values
from fedguide.report.runs import RunRecord, Runs, load_runs
from fedguide.report.tables import (LABELLED, Group, _under, describe_settings, differing_settings, group_runs,
                                    setting_value)

# Per-round metrics shown as extra columns where present: dicts (one column per entry) and scalars.
DICT_SERIES = {"domain_accuracy": "{}", "client_class_accuracy": "client {}"}
SCALAR_SERIES = {"client_accuracy_min": "client min", "client_accuracy_max": "client max"}


def _axis_prefixes(axis: str) -> tuple[str, ...]:
    return LABELLED.get(axis, (axis,))


def _axis_value(g: Group, axis: str) -> str:
    return setting_value(g.runs[0], axis, g.method_label)


def _check_axis(axis: str, runs: list[RunRecord], option: str) -> None:
    if axis in LABELLED:
        return
    if axis == "seed":
        raise ValueError(f"{option} seed: cells are means over seeds, so seed cannot be an axis; pick another "
                         "key (the results table lists each run's seeds)")
    if not any(axis in flat_keys(r.config) for r in runs):
        raise ValueError(f"{option} {axis}: no run has this config key; use method, partition, dataset or a dotted "
                         "key of the runs' config.yaml such as train.lr")


def _natural(text: str) -> tuple:
    """Numbers in numeric order (0.05 before 0.1), words alphabetically."""
    try:
        return (0, float(text), "")
    except ValueError:
        return (1, 0.0, text)


def _row_label(g: Group, row_axis: str, rest: list[str]) -> str:
    """The row's value plus the settings that vary but are not an axis (method/partition/dataset by label)."""
    parts = describe_settings(g.runs[0], rest, g.method_label)
    value = _axis_value(g, row_axis)
    return f"{value} [{', '.join(parts)}]" if parts else value


def _extra_series(groups: list[Group]) -> list[tuple[str, str]]:
    """(series key, column name) of the per-domain and per-client metrics the runs' last rounds report."""
    found: list[tuple[str, str]] = []
    for g in groups:
        for r in g.runs:
            last = r.metrics[-1] if r.metrics else {}
            for name, fmt in DICT_SERIES.items():
                if isinstance(last.get(name), dict):
                    found += [(f"{name}.{k}", fmt.format(k)) for k in last[name]]
            found += [(name, label) for name, label in SCALAR_SERIES.items() if name in last]
    return list(dict.fromkeys(found))


def pivot_data(runs: Runs, rows: str, cols: str | None = None,
               metric: str = "last_k", last_k: int | None = None) -> Table:
    """Complete runs as a ``rows`` x ``cols`` table of ``metric`` (without ``cols``: one column of it), then
    the per-domain and per-client columns; raises ValueError naming the option for a key no run has."""
    check_metric(metric)
    records = load_runs(runs)
    _check_axis(rows, records, "--rows")
    if cols is not None:
        _check_axis(cols, records, "--cols")
        if cols == rows:
            raise ValueError(f"--rows and --cols are both {rows}; pick two different keys")
    groups = [g for g in group_runs(records) if g.complete]
    if not groups:
        raise ValueError("no complete run to tabulate (a pivot shows finished runs; the results table lists the rest)")
    axes = _axis_prefixes(rows) + (_axis_prefixes(cols) if cols else ())
    rest = [k for k in differing_settings([r for g in groups for r in g.runs]) if not _under(k, axes)]

    cells: dict[tuple[str, str], list[Group]] = {}
    for g in groups:
        col = _axis_value(g, cols) if cols else METRIC_NAMES[metric]
        cells.setdefault((_row_label(g, rows, rest), col), []).append(g)
    row_names = sorted({r for r, _ in cells}, key=_natural)
    col_names = sorted({c for _, c in cells}, key=_natural) if cols else [METRIC_NAMES[metric]]
    extra = _extra_series(groups)
    header = [f"{rows} \\ {cols}" if cols else rows, *col_names]
    header += [f"{c}: {name}" if cols else name for c in col_names for _, name in extra]
    table = Table(header, numeric=set(range(1, len(header))))

    for row in row_names:
        line: list[Any] = [row, *(_cell(cells.get((row, col), []), metric, last_k, "accuracy") for col in col_names)]
        line += [_cell(cells.get((row, col), []), metric, last_k, key) for col in col_names for key, _ in extra]
        table.rows.append(line)
    bold_best(table, list(range(1, len(header))))
    table.notes = [_pivot_note(metric, len(records) - sum(len(g.runs) for g in groups), bool(extra))]
    return table


def _cell(groups: list[Group], metric: str, last_k: int | None, key: str) -> Stat | str:
    if not groups:
        return ""
    if len(groups) > 1:
        repeated = sorted({str(g.runs[0].seed) for g in groups if g.repeated_seed})
        if repeated:
            return Stat((), note=f"seed {', '.join(repeated)} repeated")
        # Groups are distinct settings; two in one cell means an axis label hides a setting.
        raise ValueError("runs with different settings land in one cell (" + "; ".join(g.label for g in groups)
                         + "); add the setting that differs as --rows or --cols")
    g = groups[0]
    return Stat(values(g.runs, metric, common_k(g.runs, last_k), key))


def _pivot_note(metric: str, left_out: int, extra: bool) -> str:
    what = {"last_k": "accuracy_last_k (mean test accuracy over the last k rounds; k even, the last 10 % of rounds "
                      "by default)",
            "final": "final-round test accuracy", "best": "best test accuracy over rounds (optimistic)",
            "personal_last_k": "the clients' mean personal test accuracy, mean over the last k scored rounds",
            "personal_min_last_k": "the lowest client's personal test accuracy, mean over the last k scored rounds",
            "personal_bottom10_last_k": "the mean personal test accuracy of the worst 10 % of clients, mean over "
                                        "the last k scored rounds"}[metric]
    note = f"Cells: {what} in %, mean ± sample std (ddof=1) over seeds; bold = best in its column."
    if extra:
        note += " Per-domain and per-client columns take the same statistic of their own per-round accuracy."
    if left_out:
        note += f" {left_out} incomplete run(s) left out."
    return note



def pivot_table(runs: Runs, rows: str, cols: str | None = None, metric: str = "last_k",
                fmt: str = "md", last_k: int | None = None) -> str:
    """``pivot_data`` rendered as Markdown (bold best, footnote), CSV or a LaTeX tabular."""
    return render(pivot_data(runs, rows, cols, metric, last_k), fmt)
