"""Grouping runs across seeds, and the results, rounds-to-accuracy and per-domain tables."""
from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Iterable

from fedguide.config import PLACEMENT_KEYS, flat_keys
from fedguide.report.formats import Num, Stat, Table, render
from fedguide.report.measures import common_k, values
from fedguide.report.runs import RunRecord, _fmt_value, Runs, load_runs

LAST_K_FOOTNOTE = (
    "*last-k acc* is the number to compare: the mean test accuracy over each run's last k evaluated rounds "
    "(k even: the last 10 % of rounds rounded up, at least 2, or `report.last_k`). Under strong label skew "
    "accuracy oscillates with period 2, so the final round alone mostly measures the phase."
)
BEST_FOOTNOTE = (
    "† *best acc* is the maximum test accuracy over all evaluated rounds. It is picked with the "
    "test set, so it is optimistic."
)
STD_FOOTNOTE = (
    "± is the sample standard deviation (ddof=1) over seeds; \"n/a\" when there is a single seed. "
    "MB up/round = `bytes_up` from metrics.jsonl in units of 10⁶ bytes, averaged over rounds, then over seeds. "
    "wall s = a run's whole cost, its set-up (feature extraction, generation, pretraining) and its rounds; the "
    "set-up part is shown beside it where a run had one worth a second."
)
BEST_VAL_FOOTNOTE = (
    "*acc at best val* is the test accuracy in the round of the best validation accuracy (data.val_fraction: "
    "training samples held out from training), the round a run picks without looking at the test set."
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

    def last_k(self, override: int | None = None) -> int:
        return common_k(self.runs, override)

    def last_k_mean(self, override: int | None = None) -> float | None:
        vals = values(self.runs, "last_k", self.last_k(override))
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
    m = g.last_k_mean()
    missing = m is None or math.isnan(m)
    return (not g.complete, missing, -(m if not missing else 0.0), g.label, g.dataset, g.partition)


# Config keys that say where or how a run was made, not what it computes: never a reason to split a row.
# ``report`` only condenses the curve (summary.json's accuracy_last_k, rounds_to_accuracy): training never reads it.
# Where and how a run computed (config.PLACEMENT_KEYS, the keys a resume may change) changes its floats only by
# rounding, as the threads do.
# ``eval.personal_every`` says how often the clients are scored besides the last k rounds: the personal last-k
# statistics, the training and the global scores are those of scoring every round. ``method_options`` has
# already given the method section what it holds for the run's method; the other methods' options ran nowhere.
NOT_SETTINGS = ("seed", "meta", "data.root", "report", "logging", "eval.personal_every", "method_options",
                *PLACEMENT_KEYS)
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
    """Rows in display order: complete groups by mean last-k accuracy (descending), then incomplete runs.

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


def _cell(v: Any) -> str:
    # A literal pipe would split the cell; labels come from user configs so this can happen.
    return str(v).replace("|", "\\|").replace("\n", " ")


HEADER = [
    "method", "dataset", "partition", "clients", "rounds", "seeds", "last k",
    "last-k acc % (mean ± std)", "final acc % (mean ± std)", "best acc† % (max over rounds, mean ± std)",
    "wall s (mean)", "MB up/round",
]
NUMERIC_COLUMNS = {3, 4, 6, 7, 8, 9, 10, 11}


READINGS_FOOTNOTE = (
    "A column named after a reading (e.g. *last_local last-k acc %*) is another reading of the global test accuracy "
    "that the method reports beside its own (metrics.jsonl's readings; FedRep's and FedPer's last_local: each "
    "client's model as its last local training left it, FedDW's inference_by_pFL), last-k mean, then mean ± std "
    "over seeds."
)


def _cost(wall: list[float], setup: list[float]) -> Num | str:
    """Mean wall seconds over seeds, with the set-up part beside it when there is one worth showing."""
    if not wall:
        return Num(None)
    mean, part = statistics.fmean(wall), statistics.fmean(setup) if setup else 0.0
    return f"{mean:.1f} (set-up {part:.1f})" if part >= 1.0 else Num(mean, ".1f")


def results_data(runs: Runs, last_k: int | None = None) -> Table:
    """One row per group of complete runs that differ only in their seed, plus one row per incomplete run;
    the config keys that tell rows apart follow as columns."""
    runs = load_runs(runs)
    groups = group_runs(runs)
    extra = list(groups[0].settings) if groups else []  # the keys that tell rows apart, one column each
    # Runs scored on the clients' own test splits (eval.mode personal/both) show that number beside the global one.
    personal = any(r.series("personal_accuracy")[1] for r in runs)
    # Runs with a validation split (data.val_fraction) show the test accuracy of the round it picks.
    validated = any(r.series("val_accuracy")[1] for r in runs)
    # Other readings of the global accuracy a method reports beside it (metrics.jsonl's readings: FedRep's and
    # FedPer's last_local), one column each.
    readings = list(dict.fromkeys(name for r in runs for m in r.metrics for name in m.get("readings", {})))
    own = (["personal last-k acc %"] if personal else []) + (["acc at best val % (mean ± std)"] if validated else []) \
        + [f"{name} last-k acc % (mean ± std)" for name in readings]
    table = Table(HEADER + own + extra, numeric=set(NUMERIC_COLUMNS) | set(range(len(HEADER), len(HEADER) + len(own))),
                  csv_names={7: ("last-k acc % mean", "last-k acc % std"), 8: ("final acc % mean", "final acc % std"),
                             9: ("best acc % mean", "best acc % std"),
                             **{len(HEADER) + i: (f"{name.split(' (')[0]} mean", f"{name.split(' (')[0]} std")
                                for i, name in enumerate(own)}})
    for g in groups:
        k = g.last_k(last_k)
        up = [v / 1e6 for v in g._values("bytes_up_per_round")]
        wall = g._values("wall_seconds")
        table.rows.append([
            g.row_label, g.dataset, g.partition, g.clients, g.rounds,
            ", ".join(str(s) for s in g.seeds), k,
            Stat(values(g.runs, "last_k", k)), Stat(values(g.runs, "final", k)), Stat(values(g.runs, "best", k)),
            _cost(wall, g._values("setup_seconds")), Num(statistics.fmean(up) if up else None, ".3f"),
            *([Stat(values(g.runs, "personal_last_k", k))] if personal else []),
            *([Stat(values(g.runs, "best_val", k))] if validated else []),
            *(Stat(values(g.runs, "last_k", k, f"readings.{name}")) for name in readings),
            *(g.settings[c] for c in extra),
        ])
    table.notes = [LAST_K_FOOTNOTE, BEST_FOOTNOTE, STD_FOOTNOTE] + ([BEST_VAL_FOOTNOTE] if validated else []) \
        + ([READINGS_FOOTNOTE] if readings else [])
    if any(g.repeated_seed for g in groups):
        table.notes.append(REPEATED_SEED_FOOTNOTE)
    if any(not r.complete for r in runs):
        table.notes.append(INCOMPLETE_FOOTNOTE)
    return table


def results_table(runs: Runs, footnotes: bool = True, fmt: str = "md",
                  last_k: int | None = None) -> str:
    """The results table as Markdown (with footnotes unless ``footnotes`` is False), CSV or LaTeX."""
    table = results_data(runs, last_k)
    if not footnotes:
        table.notes = []
    return render(table, fmt)


ROUNDS_TO_FOOTNOTE = (
    "Rounds to X %: the first round whose test accuracy reached X %, mean over the seeds that reached it; "
    "\"(r/n seeds)\" when only r of the n seeds did, \"—\" when none did within its rounds."
)


def rounds_to_table(runs: Runs, marks: list[float] | None = None) -> str:
    """Markdown table of rounds to each accuracy mark (FedDifRC Table 12), one row per group of complete
    runs; the marks are ``marks`` or those the runs recorded (``report.rounds_to``)."""
    groups = [g for g in group_runs(load_runs(runs)) if g.complete]
    if not groups:
        return ""
    if marks is None:
        marks = sorted({m for g in groups for r in g.runs for m in r.rounds_to_marks})
    lines = ["| method | dataset | partition | " + " | ".join(f"rounds to {m * 100:g} %" for m in marks) + " |",
             "|---|---|---|" + "---:|" * len(marks)]
    for g in groups:
        cells = [g.label, g.dataset, g.partition]
        for m in marks:
            reached = [r for r in (run.rounds_to(m) for run in g.runs) if r is not None]
            if not reached:
                cells.append("—")
                continue
            # Rounds are whole numbers: one decimal says a mean over seeds, and no more is meant.
            text = f"{statistics.fmean(reached):.1f}".removesuffix(".0")
            cells.append(text if len(reached) == len(g.runs) else f"{text} ({len(reached)}/{len(g.runs)} seeds)")
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(lines) + "\n\n" + ROUNDS_TO_FOOTNOTE + "\n"


def domain_table(runs: Runs, last_k: int | None = None) -> str:
    """Markdown table of per-domain test accuracy over the last k rounds (metrics.jsonl's per-round
    domain_accuracy), mean ± std over seeds, one row per group of complete runs that report domains; empty
    when no run has domains."""
    groups = [g for g in group_runs(load_runs(runs))
              if g.complete and all("domain_accuracy" in (r.summary or {}) for r in g.runs)]
    if not groups:
        return ""
    domains: list[str] = []
    for g in groups:
        for r in g.runs:
            domains += [d for d in r.summary["domain_accuracy"] if d not in domains]
    table = Table(["method", "partition", "last k", *domains], numeric=set(range(2, 3 + len(domains))))
    for g in groups:
        k = g.last_k(last_k)
        cells: list[Any] = [g.label, g.partition, k]
        for d in domains:
            cells.append(Stat(values(g.runs, "last_k", k, f"domain_accuracy.{d}")))
        table.rows.append(cells)
    return render(table, "md")


PERSONAL_FOOTNOTE = (
    "Personalised evaluation (eval.mode personal or both): each client's model after the method's personalisation "
    "step, scored on the client's own test split. *personal acc* pools every client's test samples; *min* is the "
    "worst client, *bottom 10 %* the mean of the worst tenth; each is the mean over the last k evaluated rounds, "
    "then mean ± std over seeds."
)
PERSONAL_KEYS = (("personal acc", "personal_accuracy"), ("min", "personal_accuracy_min"),
                 ("bottom 10 %", "personal_accuracy_bottom10"))


def personal_table(runs: Runs, last_k: int | None = None) -> str:
    """Markdown table of the personalised metrics (metrics.jsonl's personal_accuracy, its minimum and bottom-10 %
    over clients), one row per group of complete runs that recorded them; empty when none did."""
    groups = [g for g in group_runs(load_runs(runs))
              if g.complete and all(r.series("personal_accuracy")[1] for r in g.runs)]
    if not groups:
        return ""
    table = Table(["method", "partition", "last k", *(name for name, _ in PERSONAL_KEYS)],
                  numeric=set(range(2, 3 + len(PERSONAL_KEYS))))
    for g in groups:
        k = g.last_k(last_k)
        table.rows.append([g.label, g.partition, k, *(Stat(values(g.runs, "last_k", k, key)) for _, key in PERSONAL_KEYS)])
    return render(table, "md") + "\n" + PERSONAL_FOOTNOTE + "\n"


# Names that stand for a label rather than one config key, and the config keys each label covers.
LABELLED = {"method": ("method",), "partition": ("partition",), "dataset": ("data.name",)}


def setting_value(run: RunRecord, key: str, method_label: str | None = None) -> str:
    """A run's value of ``key``: a dotted config key, or method/partition/dataset as the tables label them."""
    if key == "method":
        return method_label or run.method
    if key == "partition":
        return run.partition_label
    if key == "dataset":
        return run.dataset
    flat = flat_keys(run.config)
    return _fmt_value(flat[key]) if key in flat else "unset"


def describe_settings(run: RunRecord, keys: Iterable[str], method_label: str | None = None) -> list[str]:
    """"key=value" for each key, the keys of a method, partition or dataset as that one label."""
    parts: list[str] = []
    for key in keys:
        name = next((a for a, prefixes in LABELLED.items() if _under(key, prefixes)), key)
        part = f"{name}={setting_value(run, name, method_label)}"
        if part not in parts:
            parts.append(part)
    return parts
