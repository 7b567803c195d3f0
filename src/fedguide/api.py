"""The Python API: the command line's runs, sweeps and reports, from a script or a notebook.

    import fedguide

    rec = fedguide.run("configs/smoke.yaml", {"method.name": "fedprox", "method.mu": 0.01}, out="runs/fedprox")
    rec.summary["accuracy_last_k"], rec.path
    recs = fedguide.sweep("configs/smoke.yaml", {"method.name": ["fedavg", "fedprox"], "seed": [0, 1]},
                          out="runs/sweep")
    print(fedguide.results_table("runs/sweep"))                       # a sweep folder, folders or records
    print(fedguide.pivot_table("runs/sweep", rows="method", cols="partition", fmt="latex"))
    print(fedguide.paired_table("runs/sweep", vs="fedavg", fmt="csv"))  # per-seed differences, 95 % intervals
    fedguide.write_report("runs/sweep", vs="fedavg")                    # report.md and plots in runs/sweep/report

A config is a YAML file's path, a mapping of the same shape, or a ``Config``; overrides are the command
line's (``["method.name=fedprox"]``) or a mapping of dotted keys to values (``{"method.mu": 0.5}``).
Runs return the run folder's ``RunRecord`` (``fedguide.report``): ``path``, ``config``, ``summary``,
``metrics``; ``load_runs`` reads them back from run folders or folders of runs. Errors are the command line's:
a ``ConfigError`` (a ``ValueError``) naming the fix.
"""
from __future__ import annotations

import contextlib
import copy
import errno
import json
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence, Union

from fedguide.config import Config, apply_overrides, build_config, load_raw
from fedguide.registry import ConfigError
from fedguide.report import (ReportOptions, ReportResult, RunRecord, load_run, load_runs, paired_table, pivot_table,
                             report, results_table)
from fedguide.report.runs import Runs

ConfigLike = Union[str, Path, Mapping[str, Any], Config]
Overrides = Union[Sequence[Union[str, tuple[str, Any]]], Mapping[str, Any]]

__all__ = ["ConfigError", "Interrupted", "Observer", "RunRecord", "dry_run", "load", "load_run", "load_runs",
           "paired_table", "pivot_table", "results_table", "resume", "run", "sweep", "write_report"]


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


class Observer:
    """What a run reports while it goes: its own lines (the header, sweep steps, the final line) to ``log``;
    the engine's lines (each round, resume notes) to ``rounds`` (default: ``log``); and its rounds to the
    display ``progress()`` returns, one per run (a ``rich.progress.Progress`` or anything with ``add_task``
    and ``update``, entered around the run when it is a context manager)."""

    def __init__(self, log: Callable[[str], None] = print, progress: Optional[Callable[[], Any]] = None,
                 rounds: Optional[Callable[[str], None]] = None):
        self.log = log
        self.rounds = rounds or log
        self.progress = progress

    @contextlib.contextmanager
    def showing(self) -> Iterator[Any]:
        """The run's progress display (None without one), shown while the block runs."""
        display = self.progress() if self.progress is not None else None
        if display is not None and hasattr(display, "__enter__"):
            with display:
                yield display
        else:
            yield display


def _observer(quiet: bool, log: Optional[Callable[[str], None]], observer: Optional[Observer]) -> Observer:
    if observer is not None:
        return observer
    return Observer((lambda s: None) if quiet else (log or print))


class Interrupted(KeyboardInterrupt):
    """A run stopped by Ctrl-C or SIGTERM; ``hint`` says how to go on from where it stopped."""

    def __init__(self, hint: str):
        super().__init__(hint)
        self.hint = hint


def load(config: ConfigLike, overrides: Optional[Overrides] = None) -> Config:
    """The validated config with ``overrides`` applied (not yet resolved against the registries:
    ``fedguide.fl.setup.resolve`` writes every entry's defaults out)."""
    raw, _ = _raw(config)
    return build_config(apply_overrides(raw, _overrides(overrides)))


def default_run_dir(stem: str, method: str, seed: int) -> Path:
    return Path("runs") / f"{stem}-{method}-s{seed}-{time.strftime('%Y%m%d-%H%M%S')}"


def final_line(summary: dict[str, Any], run_dir: Path) -> str:
    """How a run ended, led by the number to compare runs by: the mean over its last k rounds."""
    return (f"last-{summary['last_k']} accuracy {100 * summary['accuracy_last_k']:.2f}%  final "
            f"{100 * summary['final_accuracy']:.2f}%  (best {100 * summary['best_accuracy']:.2f}% at round "
            f"{summary['best_round']})  {_cost(summary)}  -> {run_dir}")


def _cost(summary: dict[str, Any]) -> str:
    """The run's seconds, set-up included, with the set-up part where it is worth a second."""
    setup = summary.get("setup_seconds", 0.0)
    return f"{summary['wall_seconds']:.0f} s" + (f" (set-up {setup:.0f} s)" if setup >= 1 else "")


def _execute(prepared: Any, folder: Any, resume: bool, observer: Observer, hint: Optional[str] = None) -> dict:
    """Run or resume ``prepared`` in ``folder``; an interruption or a crashed worker says how to go on
    (``hint``: instead of continuing this folder, e.g. a sweep's)."""
    from fedguide.fl.engine import Experiment
    from fedguide.fl.runtime import WorkerCrashed

    try:
        with observer.showing() as display:
            return Experiment(prepared, folder.path, log=observer.rounds, progress=display).run(resume=resume)
    except KeyboardInterrupt:
        raise Interrupted(hint or folder.continue_hint()) from None
    except WorkerCrashed as err:
        raise WorkerCrashed(f"{err}\n{hint or folder.continue_hint()}") from None
    except OSError as err:
        if err.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise
        # Every write is atomic and client state is committed after the round's checkpoint, so the folder
        # holds the run up to its last checkpoint whatever write the disk refused.
        raise ConfigError(f"could not write {err.filename or folder.path} ({err.strerror}). Nothing is lost: the run "
                          "folder holds every round up to its last checkpoint. Free some space, then "
                          f"{hint or folder.continue_hint()}") from None


def _grid(axes: Union[Mapping[str, Any], Sequence[str], str]) -> list[Any]:
    from fedguide.sweeps import axis, grid, parse_axis

    if isinstance(axes, str):
        axes = [axes]
    if isinstance(axes, Mapping):
        return grid([parse_axis(f"{k}={v}") if isinstance(v, str) else axis(str(k), list(v)) for k, v in axes.items()])
    return grid([parse_axis(a) for a in axes])


def dry_run(config: ConfigLike, overrides: Optional[Overrides] = None,
            axes: Union[Mapping[str, Any], Sequence[str], None] = None) -> str:
    """What ``fedguide run --dry-run`` prints: the resolved config (every default written out) and the partition
    summary, of each sweep combination when ``axes`` are given, after every check a real run makes first."""
    from fedguide.config import to_yaml
    from fedguide.data.sources import no_downloads
    from fedguide.fl.preflight import check
    from fedguide.sweeps import dry_run_text, plan

    raw, stem = _raw(config)
    # A dry run reads what is on disk and writes nothing: a data set that would be downloaded is named instead.
    with no_downloads("A dry run does not download; run without --dry-run to fetch it."):
        if axes:
            return dry_run_text(plan(raw, _overrides(overrides), _grid(axes), Path("runs") / stem))
        prepared = check(build_config(apply_overrides(raw, _overrides(overrides))))
    return to_yaml(prepared.config) + "partition summary: " + json.dumps(prepared.data.summary()) + "\n"


def run(config: ConfigLike, overrides: Optional[Overrides] = None, out: Union[str, Path, None] = None, *,
        quiet: bool = False, log: Optional[Callable[[str], None]] = None,
        observer: Optional[Observer] = None) -> RunRecord:
    """Run one experiment into ``out`` (a new folder; default ``runs/<stem>-<method>-s<seed>-<time>``) and
    return its record. Its lines go to ``observer`` (default: printed; ``log``: to that function instead;
    ``quiet``: nowhere). Ctrl-C raises ``Interrupted``, whose ``hint`` says how to continue."""
    from fedguide.fl.preflight import check, refuse_runtime
    from fedguide.fl.run_folder import HoldsRun, RunFolder
    from fedguide.fl.run_lock import RunFolderBusy

    raw, stem = _raw(config)
    # The method is built by the run itself, before anything is written.
    prepared = check(build_config(apply_overrides(raw, _overrides(overrides))), build_method=False)
    cfg = prepared.config
    folder = RunFolder(Path(out) if out is not None else default_run_dir(stem, cfg.method.name, cfg.seed))
    refuse_runtime(cfg, folder.path, resume=False)
    folder.check_fresh()  # checked again under the run folder's lock
    folder.check_writable()
    say = _observer(quiet, log, observer)
    say.log(f"{cfg.method.name} on {cfg.data.name}, {cfg.partition.name}, {prepared.data.num_clients} clients, "
            f"seed {cfg.seed} -> {folder.path}")
    try:
        summary = _execute(prepared, folder, False, say)
    except ConfigError as err:
        if not isinstance(err, (RunFolderBusy, HoldsRun)):  # refused before a round ended: the corrected
            folder.forget_refused()  # command may use the same --out
        raise
    say.log(final_line(summary, folder.path))
    return load_run(folder.path)


def resume(run_dir: Union[str, Path], *, device: Optional[str] = None, quiet: bool = False,
           log: Optional[Callable[[str], None]] = None, observer: Optional[Observer] = None,
           rebuild: bool = False) -> RunRecord:
    """Continue an interrupted run from its last checkpoint (a finished one is returned as it is).
    ``device``: continue on this device instead of the run's ``train.device`` (where a run computes is not
    part of what it is). ``rebuild``: recompute cached guidance features and fitted bases instead of reusing
    them (``guidance.rebuild``, not pinned: the hint a damaged cache gives works for a resume too)."""
    from fedguide.fl.preflight import check
    from fedguide.fl.run_folder import RunFolder

    folder = RunFolder(run_dir)
    cfg = folder.read_config()
    if device is not None:
        cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"device": device})})
    if rebuild:
        cfg = cfg.model_copy(update={"guidance": cfg.guidance.model_copy(update={"rebuild": True})})
    say = _observer(quiet, log, observer)
    folder.check_unedited(cfg)  # before "already complete": an edit of a finished run is refused, not kept
    if folder.finished(cfg.train.rounds):
        say.log(f"{folder.path} is already complete (summary.json exists); nothing to resume")
        return load_run(folder.path)
    prepared = check(cfg, folder.path, resume=True, build_method=False)
    summary = _execute(prepared, folder, True, say)
    say.log(final_line(summary, folder.path))
    return load_run(folder.path)


def sweep(config: ConfigLike, axes: Union[Mapping[str, Any], Sequence[str]], overrides: Optional[Overrides] = None,
          out: Union[str, Path, None] = None, *, quiet: bool = False,
          log: Optional[Callable[[str], None]] = None, observer: Optional[Observer] = None) -> list[RunRecord]:
    """Run every combination of ``axes`` into ``out/<folder per combination>`` and return their records.

    ``axes``: ``{"method.name": ["fedavg", "fedprox"], "seed": [0, 1]}`` or the command line's
    ``["method.name=fedavg,fedprox", "seed=[0, 1]"]``. Every combination is checked before the first run
    (a ConfigError names each invalid one); called again with the same ``out``, finished runs are
    skipped and unfinished ones continued. A run that diverges is recorded as such (a RuntimeWarning
    says so) and the others go on."""
    from fedguide.fl.run_folder import RunFolder
    from fedguide.fl.setup import prepare
    from fedguide.sweeps import plan

    raw, stem = _raw(config)
    parent = Path(out) if out is not None else Path("runs") / f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    say = _observer(quiet, log, observer)
    runs = plan(raw, _overrides(overrides), _grid(axes), parent)
    again = "run it again with the same --out" if out is not None else f"run it again with --out {parent}"
    for i, r in enumerate(runs, 1):
        head = f"[{i}/{len(runs)}] {r.combination.label}"
        if r.state in ("finished", "stopped"):
            say.log(f"{head}: {'finished' if r.state == 'finished' else 'diverged'} before, skipped -> {r.run_dir}")
            if r.state == "stopped":  # still a diverged run of the sweep: said as when it diverged
                warnings.warn(f"{r.combination.label}: diverged before (stopped.json in {r.run_dir}); run that "
                              "combination with other settings into a new --out", RuntimeWarning, stacklevel=2)
            continue
        folder = RunFolder(r.run_dir)
        folder.check_writable()
        say.log(f"{head}: {'continuing' if r.state == 'unfinished' else 'starting'} -> {r.run_dir}")
        # Round lines say whose they are: several runs' lines follow one another in one log.
        this = Observer(say.log, say.progress, rounds=lambda line, head=head: say.rounds(f"{head}  {line}"))
        try:
            summary = _execute(prepare(r.config), folder, r.state == "unfinished", this,
                               hint=f"continue the sweep: {again}")
        except FloatingPointError as err:  # stopped.json records it; the record's status says diverged
            warnings.warn(f"{r.combination.label}: {err}", RuntimeWarning, stacklevel=2)
            continue
        say.log(f"{head}: {final_line(summary, r.run_dir)}")
    return [load_run(r.run_dir) for r in runs]


def write_report(runs: Runs, out: Union[str, Path, None] = None, **options: Any) -> ReportResult:
    """``fedguide report`` over records, run folders or folders of runs: report.md and the plots into ``out``
    (default: the run's plots/ for one run, report/ beside the first run for several, replacing the report
    written there before). ``options`` are ``fedguide report``'s: ``vs``, ``rows``, ``cols``, ``metric``,
    ``fmt``, ``last_k``, ``rounds_to``, ``keep_previous`` (``ReportOptions``)."""
    records = load_runs(runs)
    return report([r.path for r in records], out, ReportOptions(**options))
