"""``--vs METHOD``: each method against a reference method, seed by seed.

A seed fixes the partition, the initial weights and the clients sampled each round, so two methods' runs
of one seed share much of their luck; their difference removes that shared part, and the spread of the
per-seed differences is what a comparison should be judged by. Runs pair when they have the same seed
and every other setting the same (the method and its regularisers aside).
"""
from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from typing import Iterable

import numpy as np

from fedguide.config import flat_keys
from fedguide.report.formats import Delta, Table, render
from fedguide.report.measures import PERSONAL_METRICS, check_metric, common_k, measure, statistic
from fedguide.report.runs import RunRecord, Runs, load_runs
from fedguide.report.tables import NOT_SETTINGS, _under, describe_settings, differing_settings, method_labels

BOOTSTRAP_RESAMPLES = 10_000
BOOTSTRAP_SEED = 0
# What "the method" covers when pairing: its own keys, the regularisers composed with it ("+dw") and the server
# optimiser ("+server_adam").
METHOD_KEYS = ("method", "regularizers", "server_optimizer")


def bootstrap_interval(diffs: Iterable[float], resamples: int = BOOTSTRAP_RESAMPLES, seed: int = BOOTSTRAP_SEED,
                       level: float = 0.95) -> tuple[float, float] | None:
    """Percentile bootstrap interval of the mean of ``diffs``: resample the differences with replacement
    ``resamples`` times (numpy, seeded: the same numbers give the same interval); None for fewer than 2."""
    d = np.asarray(list(diffs), dtype=float)
    if d.size < 2:
        return None
    rng = np.random.default_rng(seed)
    means = d[rng.integers(0, d.size, size=(resamples, d.size))].mean(axis=1)
    lo, hi = np.percentile(means, [50 * (1 - level), 50 * (1 + level)])
    return float(lo), float(hi)


@dataclass
class Comparison:
    """One method (at one set of other settings) against the reference's runs of the same settings."""

    method: str
    settings: list[str]
    k: int
    seeds: list = field(default_factory=list)  # the paired seeds, in order
    last_k: list[float] = field(default_factory=list)  # per paired seed: method - reference (fractions)
    final: list[float] = field(default_factory=list)
    unpaired: list[str] = field(default_factory=list)  # "seed 2: no fedavg run", ...

    @staticmethod
    def _mean(d: list[float]) -> float | None:
        return statistics.fmean(d) if d else None

    @property
    def mean_last_k(self) -> float | None:
        return self._mean(self.last_k)

    @property
    def mean_final(self) -> float | None:
        return self._mean(self.final)

    @property
    def interval_last_k(self) -> tuple[float, float] | None:
        return bootstrap_interval(self.last_k)

    @property
    def interval_final(self) -> tuple[float, float] | None:
        return bootstrap_interval(self.final)


def _pairing_key(run: RunRecord) -> str:
    """Every setting but the seed and the method: runs of two methods pair when these agree."""
    flat = {k: v for k, v in flat_keys(run.config).items() if not _under(k, NOT_SETTINGS + METHOD_KEYS)}
    return json.dumps(flat, sort_keys=True, default=str)


def _reference(runs: list[RunRecord], labels: dict[int, str], vs: str) -> list[RunRecord]:
    """The reference's runs: those labelled ``vs`` (fedprox(mu=0.1)), else those of method ``vs``."""
    refs = [r for r in runs if labels[id(r)] == vs] or [r for r in runs if r.method == vs]
    if not refs:
        names = ", ".join(sorted({labels[id(r)] for r in runs}))
        raise ValueError(f"--vs {vs}: no complete run of that method; the runs hold {names or 'no complete run'}")
    found = sorted({labels[id(r)] for r in refs})
    if len(found) > 1:
        raise ValueError(f"--vs {vs} names {len(found)} settings of the method ({', '.join(found)}); "
                         f"name one of them, e.g. --vs '{found[0]}'")
    return refs


def _by_seed(runs: list[RunRecord]) -> dict[str, list[RunRecord]]:
    out: dict[str, list[RunRecord]] = {}
    for r in runs:
        out.setdefault(json.dumps(r.seed, default=str), []).append(r)
    return out


def _scores(run: RunRecord, series: str, k: int) -> tuple[float | None, float | None]:
    """(last-k mean, final value) of a run's per-round ``series``."""
    if series == "accuracy":
        return run.accuracy_last(k), run.final_accuracy
    return measure(run, "last_k", k, series), measure(run, "final", k, series)


def paired_comparisons(runs: Runs, vs: str, last_k: int | None = None, metric: str = "last_k") -> list[Comparison]:
    """Per-seed differences (the last-k mean and the final value) of every other method against ``vs``; complete
    runs only. ``metric``: a personal one (``personal_last_k``, ...) compares that series instead of the
    global test accuracy. A seed without a partner, or repeated on either side, is named in ``unpaired`` and
    not used."""
    series = statistic(check_metric(metric))[1] if metric in PERSONAL_METRICS else "accuracy"
    complete = [r for r in load_runs(runs) if r.complete]
    labels = method_labels(complete)
    refs = _reference(complete, labels, vs)
    ref_label = labels[id(refs[0])]
    ref_by_key: dict[str, list[RunRecord]] = {}
    for r in refs:
        ref_by_key.setdefault(_pairing_key(r), []).append(r)
    shown = [k for k in differing_settings(complete) if not _under(k, METHOD_KEYS)]

    rows: dict[tuple[str, str], list[RunRecord]] = {}
    for r in complete:
        if labels[id(r)] != ref_label:
            rows.setdefault((labels[id(r)], _pairing_key(r)), []).append(r)
    comparisons = []
    for (label, key), members in rows.items():
        mine, theirs = _by_seed(members), _by_seed(ref_by_key.get(key, []))
        pairs: list[tuple[RunRecord, RunRecord]] = []
        unpaired: list[str] = []
        for seed in sorted(set(mine) | set(theirs), key=_seed_order):
            a, b = mine.get(seed, []), theirs.get(seed, [])
            name = f"seed {json.loads(seed)}"
            if len(a) == 1 and len(b) == 1 and a[0].rounds_done != b[0].rounds_done:
                # Equal settings on paper, different lengths on disk (a folder whose config was not updated when
                # its rounds were raised): a difference of such runs measures the extra rounds.
                unpaired.append(f"{name}: {a[0].rounds_done} rounds against {ref_label}'s {b[0].rounds_done}")
            elif len(a) == 1 and len(b) == 1 and series != "accuracy" and not (a[0].series(series)[1]
                                                                             and b[0].series(series)[1]):
                unpaired.append(f"{name}: no {series} recorded (eval.mode global)")
            elif len(a) == 1 and len(b) == 1:
                pairs.append((a[0], b[0]))
            elif not b:
                unpaired.append(f"{name}: no {ref_label} run" + _why_not(a[0], refs, seed))
            elif not a:
                unpaired.append(f"{name}: only {ref_label}")
            else:
                unpaired.append(f"{name}: repeated")
        k = common_k([r for p in pairs for r in p] or members, last_k)
        comparisons.append(Comparison(
            label, describe_settings(members[0], shown, label), k, [a.seed for a, _ in pairs],
            [_scores(a, series, k)[0] - _scores(b, series, k)[0] for a, b in pairs],
            [_scores(a, series, k)[1] - _scores(b, series, k)[1] for a, b in pairs], unpaired))
    return sorted(comparisons, key=lambda c: (c.settings, -(c.mean_last_k if c.mean_last_k is not None else -1e9)))


def _why_not(run: RunRecord, refs: list[RunRecord], seed: str) -> str:
    """Why a run of this seed found no reference partner: the settings in which the reference's runs of the
    same seed differ from it (" (model.mapping differs)"), or nothing when the reference has no run of it."""
    same_seed = [r for r in refs if json.dumps(r.seed, default=str) == seed]
    if not same_seed:
        return ""
    mine = {k: v for k, v in flat_keys(run.config).items() if not _under(k, NOT_SETTINGS + METHOD_KEYS)}
    theirs = {k: v for k, v in flat_keys(same_seed[0].config).items() if not _under(k, NOT_SETTINGS + METHOD_KEYS)}
    missing = object()
    keys = sorted(k for k in set(mine) | set(theirs) if mine.get(k, missing) != theirs.get(k, missing))
    if not keys:
        return ""
    return f" with the same settings ({', '.join(keys[:4])}{', ...' if len(keys) > 4 else ''} " \
           f"differ{'s' if len(keys) == 1 else ''})"


def _seed_order(seed: str) -> tuple:
    value = json.loads(seed)
    return (0, value, "") if isinstance(value, (int, float)) else (1, 0, str(value))


def _pp(v: float | None) -> str:
    return "n/a" if v is None else f"{v * 100:+.2f}"


def _with_interval(mean: float | None, interval: tuple[float, float] | None) -> str:
    if mean is None:
        return "n/a"
    return f"{_pp(mean)} [{_pp(interval[0])}, {_pp(interval[1])}]" if interval else f"{_pp(mean)} [n/a]"


def paired_footnote(vs: str) -> str:
    return (f"Δ = method − {vs} in percentage points, per seed, between runs that differ only in the method (same "
            "seed, same other settings); complete runs only. Shown: the mean over the paired seeds and, in "
            f"brackets, a 95 % percentile bootstrap interval of that mean ({BOOTSTRAP_RESAMPLES:,} resamples with "
            f"replacement of the per-seed differences, numpy seed {BOOTSTRAP_SEED}; \"n/a\" below 2 pairs; with few "
            "seeds it is coarse: 3 seeds allow only 10 distinct resample means). Last-k differences compare both "
            "runs over the same last k rounds. Unpaired seeds are named and not used.")


def paired_data(runs: Runs, vs: str, last_k: int | None = None, metric: str = "last_k") -> Table:
    """``paired_comparisons`` as a table, rendered like every other (Markdown with its footnote, CSV with the
    means and interval bounds as plain numbers in percentage points, a LaTeX tabular)."""
    comparisons = paired_comparisons(runs, vs, last_k, metric)
    what = "acc" if metric not in PERSONAL_METRICS else statistic(metric)[1].replace("_accuracy", " acc").replace("_", " ")
    table = Table(["method", "settings", "last k", "paired seeds", f"Δ last-k {what} pp [95 % CI]",
                   f"Δ final {what} pp [95 % CI]", "Δ last-k per seed", "unpaired"], numeric={2, 4, 5})
    for c in comparisons:
        per_seed = ", ".join(f"{s}: {_pp(d)}" for s, d in zip(c.seeds, c.last_k)) or "n/a"
        table.rows.append([c.method, ", ".join(c.settings) or "—", c.k, ", ".join(str(s) for s in c.seeds) or "none",
                           Delta(c.mean_last_k, c.interval_last_k), Delta(c.mean_final, c.interval_final),
                           per_seed, "; ".join(c.unpaired) or "—"])
    if not comparisons:
        table.rows.append([f"(no other method than {vs})", "", "", "", "", "", "", ""])
    table.notes = [paired_footnote(vs)]
    return table


def paired_table(runs: Runs, vs: str, last_k: int | None = None, fmt: str = "md", metric: str = "last_k") -> str:
    """``paired_data`` rendered: Markdown (with the footnote that says what the interval is), CSV or LaTeX."""
    return render(paired_data(runs, vs, last_k, metric), fmt)
