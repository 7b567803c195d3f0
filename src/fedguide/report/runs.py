"""Reading run directories written by the engine.

The reader is deliberately tolerant of runs that are still going (no summary.json, a
half-written last metrics line) because reports are often made while jobs are running;
anything else that is malformed raises ValueError naming the file, so a broken run is
never silently reported as a result.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Union

from pydantic import ValidationError

from fedguide.config import ReportConfig, partition_label
from fedguide.fl.run_folder import CONFIG_FILE, METRICS_FILE, SUMMARY_FILE, RunFolder


@dataclass
class RunRecord:
    path: Path
    config: dict[str, Any]
    summary: dict[str, Any] | None
    metrics: list[dict[str, Any]] = field(default_factory=list)
    partition: dict[str, Any] | None = None
    stopped: dict[str, Any] | None = None  # why the run ended without a summary ({"reason": "diverged", ...})
    warnings: list[str] = field(default_factory=list)  # what reading the run skipped

    # --- identity -------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.path.name

    @property
    def complete(self) -> bool:
        return self.summary is not None

    @property
    def status(self) -> str:
        if self.complete:
            return "complete"
        if self.stopped and self.stopped.get("reason") == "diverged":
            return f"diverged after round {self.stopped.get('after_round', '?')}"
        return f"incomplete, {self.rounds_done}/{self.rounds_planned or '?'} rounds"

    def _section(self, key: str) -> dict[str, Any]:
        sec = self.config.get(key)
        return sec if isinstance(sec, dict) else {}

    def _summary_get(self, key: str, default: Any = None) -> Any:
        return (self.summary or {}).get(key, default)

    @property
    def method(self) -> str:
        return str(self._summary_get("method") or self._section("method").get("name") or "?")

    @property
    def method_params(self) -> dict[str, Any]:
        return {k: v for k, v in self._section("method").items() if k != "name"}

    @property
    def dataset(self) -> str:
        return str(self._summary_get("dataset") or self._section("data").get("name") or "?")

    @property
    def partition_label(self) -> str:
        label = self._summary_get("partition")
        if label:
            return str(label)
        # An unfinished run has no summary: the label its summary would hold, so that it lands next to its
        # finished siblings in the table.
        sec = self._section("partition")
        if not sec:
            return "?"
        return partition_label(str(sec.get("name", "?")), {k: v for k, v in sec.items() if k != "name"})

    @property
    def seed(self) -> Any:
        seed = self._summary_get("seed")
        return seed if seed is not None else self.config.get("seed")

    @property
    def num_clients(self) -> Any:
        n = self._summary_get("num_clients")
        return n if n is not None else self._section("clients").get("num")

    @property
    def rounds_planned(self) -> int | None:
        r = self._summary_get("rounds")
        if r is None:
            r = self._section("train").get("rounds")
        return int(r) if r is not None else None

    @property
    def rounds_done(self) -> int:
        rounds = [m["round"] for m in self.metrics if isinstance(m.get("round"), (int, float))]
        if rounds:
            return int(max(rounds))
        if self.summary is not None:
            return len(self.summary.get("accuracy_curve") or [])
        return 0

    @property
    def git_commit(self) -> str | None:
        meta = self._section("meta")
        return meta.get("git_commit")

    # --- results --------------------------------------------------------------
    def accuracy_series(self) -> tuple[list[int], list[float]]:
        """(rounds, accuracies); prefers metrics.jsonl because it carries explicit round numbers."""
        rounds, values = self.series("accuracy")
        if rounds:
            return rounds, values
        curve = self._summary_get("accuracy_curve") or []
        return list(range(1, len(curve) + 1)), [float(v) for v in curve]

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """Any numeric per-round metric; ``a.b`` reaches into dict-valued metrics such as
        ``domain_accuracy.sketch``, so extra engine metrics stay usable without code here."""
        rounds: list[int] = []
        values: list[float] = []
        for i, row in enumerate(self.metrics, start=1):
            val: Any = row
            for part in key.split("."):
                val = val.get(part) if isinstance(val, dict) else None
            if isinstance(val, (int, float)) and not isinstance(val, bool):
                rounds.append(int(row.get("round", i)))
                values.append(float(val))
        return rounds, values

    def numeric_metric_keys(self) -> list[str]:
        keys: set[str] = set()
        for row in self.metrics:
            for k, v in row.items():
                if isinstance(v, dict):
                    keys.update(f"{k}.{sk}" for sk, sv in v.items() if _is_number(sv))
                elif _is_number(v):
                    keys.add(k)
        return sorted(keys)

    @property
    def final_accuracy(self) -> float | None:
        if self.summary is not None and self.summary.get("final_accuracy") is not None:
            return float(self.summary["final_accuracy"])
        _, acc = self.accuracy_series()
        return acc[-1] if acc else None

    @property
    def best_accuracy(self) -> float | None:
        if self.summary is not None and self.summary.get("best_accuracy") is not None:
            return float(self.summary["best_accuracy"])
        _, acc = self.accuracy_series()
        finite = [a for a in acc if not math.isnan(a)]
        return max(finite) if finite else None

    @property
    def setup_seconds(self) -> float | None:
        """The set-up part of ``wall_seconds`` (runs written before it was recorded: None)."""
        value = self._summary_get("setup_seconds")
        return float(value) if value is not None else None

    @property
    def wall_seconds(self) -> float | None:
        if self.summary is not None and self.summary.get("wall_seconds") is not None:
            return float(self.summary["wall_seconds"])
        _, secs = self.series("seconds")
        return sum(secs) if secs else None

    @property
    def report_config(self) -> ReportConfig:
        """The run's ``report:`` section; runs made before it existed get its defaults."""
        try:
            return ReportConfig.model_validate(self._section("report"))
        except ValidationError as err:
            raise ValueError(f"{self.path / CONFIG_FILE}: report section is invalid "
                             f"({err.errors()[0]['msg'].removeprefix('Value error, ')})") from None

    @property
    def last_k(self) -> int:
        """The window of the run's accuracy_last_k: summary.json's, else what the engine would choose for
        the planned rounds, never more than the rounds evaluated so far."""
        k = self._summary_get("last_k")
        if k is not None:
            return int(k)
        evaluated = len(self.accuracy_series()[1])
        return min(self.report_config.last_k_for(self.rounds_planned or evaluated), evaluated)

    def accuracy_last(self, k: int | None = None) -> float | None:
        """Mean test accuracy over the last ``k`` evaluated rounds (default: the run's own last_k); runs
        written before summary.json carried accuracy_last_k get it from their curve."""
        k = self.last_k if k is None else k
        stored = self._summary_get("accuracy_last_k")
        if stored is not None and k == self._summary_get("last_k"):
            return float(stored)
        return last_k_mean(self.accuracy_series()[1], k)

    @property
    def accuracy_last_k(self) -> float | None:
        return self.accuracy_last()

    @property
    def rounds_to_marks(self) -> list[float]:
        """The accuracy marks the run recorded (its report.rounds_to; the defaults for older runs)."""
        recorded = self._summary_get("rounds_to_accuracy")
        if isinstance(recorded, dict) and recorded:
            return sorted(float(m) for m in recorded)
        return list(self.report_config.rounds_to)

    def rounds_to(self, mark: float) -> int | None:
        """First round whose test accuracy reached ``mark``; None when no round did."""
        rounds, acc = self.accuracy_series()
        return next((r for r, a in zip(rounds, acc) if a >= mark), None)

    @property
    def bytes_up_per_round(self) -> float | None:
        _, up = self.series("bytes_up")
        return sum(up) / len(up) if up else None


def last_k_mean(values: list[float], k: int) -> float | None:
    """Mean of the last ``k`` values (all of them when there are fewer); None for no values."""
    if not values or k < 1:
        return None
    tail = values[-k:]
    return sum(tail) / len(tail)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _fmt_value(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:g}"
    if isinstance(v, (dict, list)):
        return json.dumps(v, sort_keys=True, separators=(",", ":"))
    return str(v)


def load_run(path: str | Path) -> RunRecord:
    """Load one run directory; raises ValueError if ``path`` is not one."""
    folder = RunFolder(path)
    if not folder.path.is_dir() or not folder.written():
        what = ("is not a directory" if not folder.path.is_dir()
                else f"has no {CONFIG_FILE}, {METRICS_FILE} or {SUMMARY_FILE}")
        raise ValueError(f"{folder.path} is not a run directory: it {what} (pass a run folder written by fedguide; "
                         "for a folder of runs, such as a sweep's --out, use load_runs)")
    summary = folder.read_summary()
    warnings: list[str] = []
    metrics = folder.read_metrics(running=summary is None, warnings=warnings)
    config = folder.read_run_config(warnings)  # the settings the checkpoint pins, not a later edit
    return RunRecord(path=folder.path, config=config, summary=summary, metrics=metrics,
                     partition=folder.read_partition(), stopped=folder.read_stopped() if summary is None else None,
                     warnings=warnings)


# What a report function takes: records, run folders, folders of runs (a sweep's --out), one or several.
Runs = Union[RunRecord, str, Path, Iterable[Union[RunRecord, str, Path]]]


def load_runs(runs: Runs) -> list[RunRecord]:
    """Records of run folders, of the run folders below any other folder given (a sweep's --out), and of
    records passed as they are; one path (a string too) or several."""
    from fedguide.report.discover import find_run_dirs

    items = [runs] if isinstance(runs, (RunRecord, str, Path)) else list(runs)
    out: list[RunRecord] = []
    for item in items:
        out += [item] if isinstance(item, RunRecord) else [load_run(p) for p in find_run_dirs([item])]
    return out
