"""Which figures ``fedguide analyze`` makes for a run (the figures are ``FIGURES``' entries, figure.py).

Asked for by name, a figure that does not apply is an error naming the reason; with no figure named,
every figure that applies is made and the others are skipped with their reason.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

from fedguide.analysis.figure import FIGURES, in_order, option
from fedguide.registry import ConfigError


@dataclass
class AnalysisResult:
    run_dir: Path
    written: dict[str, list[Path]] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)  # figure -> why it does not apply


def analyze(run_dir: Path | str, figures: Optional[Sequence[str]] = None, points: int = 2000, seed: int = 0,
            log: Callable[[str], None] = lambda s: None) -> AnalysisResult:
    """Write the asked figures (default: every one that applies) of a finished run into RUN/analysis/."""
    from fedguide.analysis.opened import AnalysisRun

    ordered = [entry.name for entry in in_order()]
    unknown = [f for f in figures or () if f not in FIGURES]
    if unknown:
        raise ConfigError(f"unknown figure(s) {unknown}; choose from {', '.join(ordered)}")
    if points < 1:
        raise ConfigError(f"points={points}: ask for at least 1")
    run = AnalysisRun(run_dir)
    result = AnalysisResult(run.run_dir)
    names = list(dict.fromkeys(figures)) if figures else ordered
    todo = []
    for name in names:  # every refusal before the first figure is computed
        figure = FIGURES.get(name).obj()
        reason = (f"points={points} is too few for it; ask for at least {figure.min_points}"
                  if points < figure.min_points else figure.applies(run))
        if reason is None:
            todo.append((name, figure))
        elif figures:
            raise ConfigError(f"{option(name)} does not apply to {run.run_dir}: {reason}")
        else:
            result.skipped[name] = reason
            log(f"{name}: skipped ({reason})")
    for name, figure in todo:
        log(f"{name}: computing")
        result.written[name] = figure.make(run, points=points, seed=seed)
    return result
