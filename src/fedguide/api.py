"""The Python API: the command line's runs, sweeps and reports, from a script or a notebook.

    import fedguide

    rec = fedguide.run("configs/smoke.yaml", {"method.name": "fedprox", "method.mu": 0.01}, out="runs/fedprox")
    rec.summary["final_accuracy"], rec.path
    recs = fedguide.sweep("configs/smoke.yaml", {"method.name": ["fedavg", "fedprox"], "seed": [0, 1]},
                          out="runs/sweep")
    print(fedguide.results_table(recs))
    fedguide.write_report(recs, "runs/sweep/report")

A config is a YAML file's path, a mapping of the same shape, or a ``Config``; overrides are the command
line's (``["method.name=fedprox"]``) or a mapping of dotted keys to values (``{"method.mu": 0.5}``).
Runs return the run folder's ``RunRecord`` (``fedguide.report``): ``path``, ``config``, ``summary``,
``metrics``. Errors are the command line's: a ``ConfigError`` (a ``ValueError``) naming the fix.
"""
from __future__ import annotations

import copy
import json
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence, Union

from fedguide.config import Config, apply_overrides, build_config, load_raw
from fedguide.registry import ConfigError
from fedguide.report import ReportResult, RunRecord, load_run, report, results_table

ConfigLike = Union[str, Path, Mapping[str, Any], Config]
Overrides = Union[Sequence[Union[str, tuple[str, Any]]], Mapping[str, Any]]

__all__ = ["ConfigError", "RunRecord", "load", "load_run", "results_table", "resume", "run", "sweep",
           "write_report"]


def _raw(config: ConfigLike) -> tuple[dict[str, Any], str]:
    """(the config as a mapping, the stem default folder names start with)."""
    if isinstance(config, Config):
        raw = config.model_dump(mode="json")
        raw.pop("meta", None)  # versions of the run it came from; a new run writes its own
        return raw, "config"
    if isinstance(config, Mapping):
        return copy.deepcopy(dict(config)), "config"
    if isinstance(config, (str, Path)):
        return load_raw(Path(config)), Path(config).stem
    raise ConfigError(f"config is a {type(config).__name__}; pass a YAML file's path, a mapping or a fedguide Config")


def _overrides(overrides: Optional[Overrides]) -> list[Union[str, tuple[str, Any]]]:
    if overrides is None:
        return []
    if isinstance(overrides, str):
        return [overrides]
    if isinstance(overrides, Mapping):
        return [(str(k), v) for k, v in overrides.items()]
    return list(overrides)


def _logger(quiet: bool, log: Optional[Callable[[str], None]]) -> Callable[[str], None]:
    return (lambda s: None) if quiet else (log or print)


def load(config: ConfigLike, overrides: Optional[Overrides] = None) -> Config:
    """The validated config with ``overrides`` applied (not yet resolved against the registries:
    ``fedguide.fl.setup.resolve`` writes every entry's defaults out)."""
    raw, _ = _raw(config)
    return build_config(apply_overrides(raw, _overrides(overrides)))


def default_run_dir(stem: str, method: str, seed: int) -> Path:
    return Path("runs") / f"{stem}-{method}-s{seed}-{time.strftime('%Y%m%d-%H%M%S')}"


def check_writable(run_dir: Path) -> None:
    """The run folder exists (made here) and takes files, or a sentence says why not."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=run_dir):
            pass
    except OSError as err:
        raise ConfigError(f"cannot write the run folder {run_dir}: {err.strerror or err} "
                          f"({err.filename or run_dir}); choose another --out, a folder you can write to") from None


def run(config: ConfigLike, overrides: Optional[Overrides] = None, out: Union[str, Path, None] = None, *,
        quiet: bool = False, log: Optional[Callable[[str], None]] = None) -> RunRecord:
    """Run one experiment into ``out`` (a new folder; default ``runs/<stem>-<method>-s<seed>-<time>``) and
    return its record. ``quiet`` silences the per-round lines (printed, or passed to ``log``)."""
    from fedguide.fl.engine import Experiment, check_fresh
    from fedguide.fl.runtimes.base import RUNTIMES
    from fedguide.fl.setup import prepare

    raw, stem = _raw(config)
    prepared = prepare(build_config(apply_overrides(raw, _overrides(overrides))))
    cfg = prepared.config
    run_dir = Path(out) if out is not None else default_run_dir(stem, cfg.method.name, cfg.seed)
    refusal = RUNTIMES.get(cfg.runtime.name).obj.refuses(run_dir, resume=False)
    if refusal:
        raise ConfigError(refusal)
    check_fresh(run_dir)
    check_writable(run_dir)
    Experiment(prepared, run_dir, log=_logger(quiet, log)).run()
    return load_run(run_dir)


def resume(run_dir: Union[str, Path], *, quiet: bool = False, log: Optional[Callable[[str], None]] = None) -> RunRecord:
    """Continue an interrupted run from its last checkpoint (a finished one is returned as it is)."""
    from fedguide.fl.engine import Experiment
    from fedguide.fl.runtimes.base import RUNTIMES
    from fedguide.fl.setup import load_run_config, prepare

    run_dir = Path(run_dir)
    cfg = load_run_config(run_dir)
    done = run_dir / "summary.json"
    if done.is_file() and json.loads(done.read_text()).get("rounds", 0) >= cfg.train.rounds:
        return load_run(run_dir)
    refusal = RUNTIMES.get(cfg.runtime.name).obj.refuses(run_dir, resume=True)
    if refusal:
        raise ConfigError(refusal)
    Experiment(prepare(cfg), run_dir, log=_logger(quiet, log)).run(resume=True)
    return load_run(run_dir)


def sweep(config: ConfigLike, axes: Union[Mapping[str, Any], Sequence[str]], overrides: Optional[Overrides] = None,
          out: Union[str, Path, None] = None, *, quiet: bool = False,
          log: Optional[Callable[[str], None]] = None) -> list[RunRecord]:
    """Run every combination of ``axes`` into ``out/<folder per combination>`` and return their records.

    ``axes``: ``{"method.name": ["fedavg", "fedprox"], "seed": [0, 1]}`` or the command line's
    ``["method.name=fedavg,fedprox", "seed=[0, 1]"]``. Every combination is checked before the first run
    (a ConfigError names each invalid one); called again with the same ``out``, finished runs are
    skipped and unfinished ones continued. A run that diverges is recorded as such (a RuntimeWarning
    says so) and the others go on."""
    from fedguide.fl.engine import Experiment
    from fedguide.fl.setup import prepare
    from fedguide.sweeps import axis, grid, parse_axis, plan

    if isinstance(axes, str):
        axes = [axes]
    if isinstance(axes, Mapping):
        parsed = [parse_axis(f"{k}={v}") if isinstance(v, str) else axis(str(k), list(v)) for k, v in axes.items()]
    else:
        parsed = [parse_axis(a) for a in axes]
    raw, stem = _raw(config)
    parent = Path(out) if out is not None else Path("runs") / f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    say = _logger(quiet, log)
    runs = plan(raw, _overrides(overrides), grid(parsed), parent)
    for r in runs:
        if r.state in ("finished", "stopped"):
            say(f"{r.combination.label}: {'finished' if r.state == 'finished' else 'diverged'} before, skipped")
            continue
        check_writable(r.run_dir)
        say(f"{r.combination.label}: {'continuing' if r.state == 'unfinished' else 'starting'} -> {r.run_dir}")
        try:
            Experiment(prepare(r.config), r.run_dir, log=say).run(resume=r.state == "unfinished")
        except FloatingPointError as err:  # stopped.json records it; the record's status says diverged
            warnings.warn(f"{r.combination.label}: {err}", RuntimeWarning, stacklevel=2)
    return [load_run(r.run_dir) for r in runs]


def write_report(runs: Iterable[Union[RunRecord, str, Path]], out: Union[str, Path, None] = None) -> ReportResult:
    """``fedguide report`` over run records or folders: report.md and the plots into ``out`` (default:
    the run's plots/ for one run, a new report-<time>/ beside the first run for several)."""
    return report([r.path if isinstance(r, RunRecord) else Path(r) for r in runs], out)
