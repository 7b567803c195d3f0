"""Grouping runs across seeds and rendering the Markdown results table."""
from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from fedguide.config import flat_keys
from fedguide.report.runs import RunRecord, _fmt_value, as_records

BEST_FOOTNOTE = (
    "† *best acc* is the maximum test accuracy over all evaluated rounds. It is picked with the "
    "test set, so it is optimistic; *final acc* (last round) is the number to compare."
)
STD_FOOTNOTE = (
    "± is the sample standard deviation (ddof=1) over seeds; \"n/a\" when there is a single seed. "
    "MB up/round = `bytes_up` from metrics.jsonl in units of 10⁶ bytes, averaged over rounds, then over seeds."
)
REPEATED_SEED_FOOTNOTE = (
    "Runs marked \"seed repeated\" share every setting and their seed with another run: two runs of one seed are "
    "not independent samples, so they are shown side by side, never averaged."
)
INCOMPLETE_FOOTNOTE = (
    "Incomplete runs (no summary.json yet) are listed on their own rows, after the complete ones, "
    "with their latest/best accuracy so far; they are never averaged with complete runs."
)


@dataclass
class Group:
    """One table row: runs that differ only by seed, or a single incomplete run."""

    method_label: str
    dataset: str
    partition: str
    clients: Any
    rounds: int | None
    runs: list[RunRecord]
    complete: bool
    # The config keys (dotted) in which this row's runs differ from other rows' and their values here.
    settings: dict[str, str] = field(default_factory=dict)
    repeated_seed: bool = False  # a run whose seed and settings another run shares: never averaged

    @property
    def row_label(self) -> str:
        """The method label and the run's state; the settings are separate columns of the table."""
        if self.repeated_seed:
            return f"{self.method_label} (seed {self.runs[0].seed} repeated)"
        if self.complete:
            return self.method_label
        return f"{self.method_label} ({self.runs[0].status})"

    @property
    def label(self) -> str:
        """Display name with the settings that tell the rows apart, also the legend entry in plots."""
        if not self.settings:
            return self.row_label
        return f"{self.row_label} [{', '.join(f'{k}={v}' for k, v in self.settings.items())}]"

    @property
    def seeds(self) -> list[Any]:
        seeds = [r.seed for r in self.runs]
        try:
            return sorted(seeds)
        except TypeError:  # mixed None/int seeds from hand-written configs
            return seeds

    def _values(self, attr: str) -> list[float]:
        return [v for v in (getattr(r, attr) for r in self.runs) if v is not None]

    @property
    def final_mean(self) -> float | None:
        vals = self._values("final_accuracy")
        return statistics.fmean(vals) if vals else None


def _canonical(v: Any) -> str:
    return json.dumps(v, sort_keys=True, default=str)


def method_labels(runs: Iterable[RunRecord]) -> dict[int, str]:
    """Label per run (keyed by id): the method name plus only those params that vary between runs
    of that method, so fedprox mu=0.01 and mu=0.1 get separate rows while a table with a single
    setting stays uncluttered."""
    runs = list(runs)
    by_method: dict[str, list[RunRecord]] = {}
    for r in runs:
        by_method.setdefault(r.method, []).append(r)

    labels: dict[int, str] = {}
    for method, members in by_method.items():
        keys = sorted({k for r in members for k in r.method_params})
        varying = [
            k for k in keys
            if len({_canonical(r.method_params[k]) if k in r.method_params else "<missing>"
                    for r in members}) > 1
        ]
        for r in members:
            parts = [f"{k}={_fmt_value(r.method_params[k])}" for k in varying if k in r.method_params]
            labels[id(r)] = f"{method}({', '.join(parts)})" if parts else method
    return labels


def _sort_key(g: Group) -> tuple:
    m = g.final_mean
    missing = m is None or math.isnan(m)
    return (not g.complete, missing, -(m if not missing else 0.0), g.label, g.dataset, g.partition)


# Config keys that say where or how a run was made, not what it computes: never a reason to split a row.
NOT_SETTINGS = ("seed", "meta", "data.root", "guidance.rebuild", "guidance.feature_cache", "guidance.device")
# Keys every row already shows in a column of its own (method parameters are in the method label).
SHOWN = ("method", "data.name", "partition", "clients.num", "train.rounds")


def _under(key: str, prefixes: tuple[str, ...]) -> bool:
    return any(key == p or key.startswith(p + ".") for p in prefixes)


def differing_settings(runs: list[RunRecord]) -> list[str]:
    """The dotted config keys whose value is not the same in every run (a missing key is a value too)."""
    flats = [flat_keys(r.config) for r in runs]
    keys = sorted({k for f in flats for k in f if not _under(k, NOT_SETTINGS)})
    return [k for k in keys if len({_canonical(f.get(k, "<unset>")) for f in flats}) > 1]


def group_runs(runs: Iterable[RunRecord]) -> list[Group]:
    """Rows in display order: complete groups by final mean accuracy (descending), then incomplete runs.

    Runs share a row when they differ in their seed alone: every other config key that differs between
    the runs (train.lr, data.fraction, ...) splits the rows and is shown. Two runs of the same seed and
    settings are never averaged (they are not independent samples): each gets its own row, marked.
    """
    runs = list(runs)
    labels = method_labels(runs)
    varying = [k for k in differing_settings(runs) if not _under(k, SHOWN)]
    complete: dict[tuple, Group] = {}
    rows: list[Group] = []
    for r in runs:
        flat = flat_keys(r.config)
        settings = {k: _fmt_value(flat[k]) if k in flat else "unset" for k in varying}
        key = (labels[id(r)], r.dataset, r.partition_label, _canonical(r.num_clients), r.rounds_planned,
               _canonical(settings))
        if r.complete:
            if key not in complete:
                complete[key] = Group(labels[id(r)], r.dataset, r.partition_label, r.num_clients,
                                      r.rounds_planned, [], True, settings)
                rows.append(complete[key])
            complete[key].runs.append(r)
        else:
            rows.append(Group(labels[id(r)], r.dataset, r.partition_label, r.num_clients,
                              r.rounds_planned, [r], False, settings))
    return sorted((row for g in rows for row in _split_repeated_seeds(g)), key=_sort_key)


def _split_repeated_seeds(g: Group) -> list[Group]:
    seeds = [_canonical(r.seed) for r in g.runs]
    if len(set(seeds)) == len(seeds):
        return [g]
    return [Group(g.method_label, g.dataset, g.partition, g.clients, g.rounds, [r], g.complete, g.settings,
                  repeated_seed=seeds.count(_canonical(r.seed)) > 1) for r in g.runs]


def _pct_mean_std(vals: list[float]) -> str:
    if not vals:
        return "n/a"
    mean = statistics.fmean(vals) * 100
    std = f"{statistics.stdev(vals) * 100:.2f}" if len(vals) > 1 else "n/a"
    return f"{mean:.2f} ± {std}"


def _mean(vals: list[float], fmt: str) -> str:
    return format(statistics.fmean(vals), fmt) if vals else "n/a"


def _cell(v: Any) -> str:
    # A literal pipe would split the cell; labels come from user configs so this can happen.
    return str(v).replace("|", "\\|").replace("\n", " ")


HEADER = [
    "method", "dataset", "partition", "clients", "rounds", "seeds",
    "final acc % (mean ± std)", "best acc† % (max over rounds, mean ± std)",
    "wall s (mean)", "MB up/round",
]


def results_table(runs: Iterable[RunRecord | str | Path], footnotes: bool = True) -> str:
    """Markdown table, one row per (method label, dataset, partition) group of complete runs,
    plus one row per incomplete run."""
    runs = as_records(runs)
    groups = group_runs(runs)
    extra = list(groups[0].settings) if groups else []  # the keys that tell rows apart, one column each
    lines = ["| " + " | ".join(HEADER + extra) + " |",
             "|" + "|".join(["---"] * 3 + ["---:"] * 7 + ["---"] * len(extra)) + "|"]
    for g in groups:
        up = [v / 1e6 for v in g._values("bytes_up_per_round")]
        cells = [
            g.row_label, g.dataset, g.partition,
            "n/a" if g.clients is None else g.clients,
            "n/a" if g.rounds is None else g.rounds,
            ", ".join(str(s) for s in g.seeds),
            _pct_mean_std(g._values("final_accuracy")),
            _pct_mean_std(g._values("best_accuracy")),
            _mean(g._values("wall_seconds"), ".1f"),
            _mean(up, ".3f"),
            *(g.settings[k] for k in extra),
        ]
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    text = "\n".join(lines) + "\n"
    if footnotes:
        notes = [BEST_FOOTNOTE, STD_FOOTNOTE]
        if any(g.repeated_seed for g in groups):
            notes.append(REPEATED_SEED_FOOTNOTE)
        if any(not r.complete for r in runs):
            notes.append(INCOMPLETE_FOOTNOTE)
        text += "\n" + "\n\n".join(notes) + "\n"
    return text


def domain_table(runs: Iterable[RunRecord | str | Path]) -> str:
    """Markdown table of final per-domain test accuracy (mean ± std over seeds), one row per group of
    complete runs that report it; empty when no run has domains."""
    groups = [g for g in group_runs(as_records(runs))
              if g.complete and all("domain_accuracy" in (r.summary or {}) for r in g.runs)]
    if not groups:
        return ""
    domains: list[str] = []
    for g in groups:
        for r in g.runs:
            domains += [d for d in r.summary["domain_accuracy"] if d not in domains]
    lines = ["| method | partition | " + " | ".join(_cell(d) for d in domains) + " |",
             "|---|---|" + "---:|" * len(domains)]
    for g in groups:
        cells = [g.label, g.partition]
        for d in domains:
            cells.append(_pct_mean_std([r.summary["domain_accuracy"][d] for r in g.runs
                                        if d in r.summary["domain_accuracy"]]))
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"
