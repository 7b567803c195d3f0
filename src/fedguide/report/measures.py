"""The one number a run contributes to a table cell.

``last_k`` (the default, the number to compare) is the mean test accuracy over the last k evaluated
rounds; ``final`` the last round's; ``best`` the maximum over rounds (picked with the test set, so
optimistic); ``best_val`` the test accuracy at the round of the best validation accuracy (``data.val_fraction``:
the round a run picks without looking at the test set). Per-domain and per-client columns take the same
statistic of their own per-round series.
"""
from __future__ import annotations

import math
from typing import Iterable

from fedguide.core.evaluation import first_best
from fedguide.report.runs import RunRecord, last_k_mean

METRICS = ("last_k", "final", "best", "best_val")
# Personalised evaluation (eval.mode personal/both): the mean over the last k scored rounds of the clients'
# mean personal accuracy, its minimum over clients, and the mean of the worst 10 % of clients.
PERSONAL_METRICS = {"personal_last_k": "personal_accuracy", "personal_min_last_k": "personal_accuracy_min",
                    "personal_bottom10_last_k": "personal_accuracy_bottom10"}
ALL_METRICS = (*METRICS, *PERSONAL_METRICS)
# Column names of a cell's statistic: the cells are percentages (summary.json holds the same under
# accuracy_last_k, final_accuracy and best_accuracy as fractions).
METRIC_NAMES = {"last_k": "last-k acc %", "final": "final acc %", "best": "best acc %",
                "best_val": "acc at best val %",
                "personal_last_k": "personal last-k acc %", "personal_min_last_k": "personal min last-k acc %",
                "personal_bottom10_last_k": "personal bottom-10 % last-k acc %"}


def check_metric(metric: str) -> str:
    if metric not in ALL_METRICS:
        raise ValueError(f"unknown metric '{metric}'; choose one of {', '.join(ALL_METRICS)}")
    return metric


def statistic(metric: str, key: str = "accuracy") -> tuple[str, str]:
    """(the statistic over rounds, the per-round series) a metric names: a personal metric is the last-k
    statistic of its own series; the others take ``key``'s (accuracy, or a domain's or client's)."""
    return ("last_k", PERSONAL_METRICS[metric]) if metric in PERSONAL_METRICS else (metric, key)


def common_k(runs: Iterable[RunRecord], override: int | None = None) -> int:
    """One window for runs compared with each other: ``override``, else the largest of the runs' own
    (they agree unless report.last_k differed; recomputing at one k keeps the mean over seeds one
    statistic)."""
    runs = list(runs)
    if override is not None:
        if override < 1:
            raise ValueError(f"--last-k {override} is not a positive number of rounds; write e.g. --last-k 10")
        # A window longer than a run would average that run over fewer rounds than the k the table shows.
        short = sorted({n for r in runs if (n := len(r.accuracy_series()[1])) < override})
        if short:
            raise ValueError(f"--last-k {override} exceeds the {short[0]} evaluated rounds of "
                             f"{sum(len(r.accuracy_series()[1]) < override for r in runs)} of the runs; write "
                             f"--last-k {short[0]} or fewer, or report those runs apart")
        return override
    ks = [r.last_k for r in runs]
    return max(ks) if ks else 0


def at_best_validation(run: RunRecord, key: str = "accuracy") -> float | None:
    """``key`` in the round of the run's best validation accuracy (the first such round); None without a
    validation split."""
    rounds, vals = run.series("val_accuracy")
    if not vals:
        return None
    picked = rounds[first_best(vals)]
    return dict(zip(*run.series(key))).get(picked)


def measure(run: RunRecord, metric: str, k: int, key: str = "accuracy") -> float | None:
    """``metric`` of the run's per-round ``key`` (``accuracy``, ``domain_accuracy.<d>``, ...)."""
    if metric == "best_val":
        return at_best_validation(run, key)
    if key == "accuracy":
        if metric == "last_k":
            return run.accuracy_last(k)
        return run.final_accuracy if metric == "final" else run.best_accuracy
    values = [v for v in run.series(key)[1] if not math.isnan(v)] if metric == "best" else run.series(key)[1]
    if not values:
        return None
    if metric == "last_k":
        return last_k_mean(values, k)
    return values[-1] if metric == "final" else max(values)


def values(runs: Iterable[RunRecord], metric: str, k: int, key: str = "accuracy") -> tuple[float, ...]:
    metric, key = statistic(metric, key)
    return tuple(v for v in (measure(r, metric, k, key) for r in runs) if v is not None)
