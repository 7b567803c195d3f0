"""The one number a run contributes to a table cell.

``last_k`` (the default, the number to compare) is the mean test accuracy over the last k evaluated
rounds; ``final`` the last round's; ``best`` the maximum over rounds (picked with the test set, so
optimistic). Per-domain and per-client columns take the same statistic of their own per-round series.
"""
from __future__ import annotations

import math
from typing import Iterable

from fedguide.report.runs import RunRecord, last_k_mean

METRICS = ("last_k", "final", "best")
# Column names of a cell's statistic: the cells are percentages (summary.json holds the same under
# accuracy_last_k, final_accuracy and best_accuracy as fractions).
METRIC_NAMES = {"last_k": "last-k acc %", "final": "final acc %", "best": "best acc %"}


def check_metric(metric: str) -> str:
    if metric not in METRICS:
        raise ValueError(f"unknown metric '{metric}'; choose one of {', '.join(METRICS)}")
    return metric


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


def measure(run: RunRecord, metric: str, k: int, key: str = "accuracy") -> float | None:
    """``metric`` of the run's per-round ``key`` (``accuracy``, ``domain_accuracy.<d>``, ...)."""
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
    return tuple(v for v in (measure(r, metric, k, key) for r in runs) if v is not None)
