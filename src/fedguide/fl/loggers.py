"""Metric loggers a config names under ``logging:``: ``csv``, ``tensorboard``, ``wandb``.

metrics.jsonl is the run's record; these are views of it for other tools. The engine opens them with the
rows already committed (a resumed run's history), calls ``log`` after each round's metrics are committed
(checkpoint, metrics.jsonl and client state on disk), and closes them when the run ends, however it ends.

This file holds
- ``MetricLogger``: the protocol (``log(row, rows)``, ``close()``) and ``LOGGERS``, the registry of
  factories ``(run_dir, config, committed rows) -> MetricLogger``;
- ``scalars``: a metrics row as flat scalar columns: nested mappings become ``outer/inner`` (TensorBoard
  groups tags by their prefix), lists (the round's client ids) are left out, booleans become 0/1;
- ``csv``: ``metrics.csv`` beside metrics.jsonl, rewritten atomically from every committed row each
  round, so it always agrees with metrics.jsonl (after a resume too) and gains a column when a later
  round brings a new metric;
- ``tensorboard``: event files under ``<run>/tensorboard/`` (torch's SummaryWriter), flushed every round.
  A resumed run opens the writer with ``purge_step=1`` and logs the committed rows again, so TensorBoard
  hides whatever the interrupted process wrote and shows exactly the committed history;
- ``wandb``: a Weights & Biases run (``WANDB_PROJECT``, default ``fedguide``; entity, mode and the rest
  from wandb's own environment variables). Its id is kept in ``<run>/wandb/fedguide-run-id`` so a
  resumed run continues the same W&B run; W&B cannot rewrite steps, so a resume logs only the rounds
  after its checkpoint (a W&B run started on resume first logs the committed history).

``check_available`` refuses, before a run starts, a logger whose package is missing, naming the pip
command: none of them is required to run fedguide.
"""
from __future__ import annotations

import csv
import importlib
import io
import os
import uuid
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Optional, Protocol

from fedguide.core.atomic import write_text
from fedguide.registry import ConfigError, Registry


class MetricLogger(Protocol):
    def log(self, row: dict[str, Any], rows: list[dict[str, Any]]) -> None:
        """``row``: the round just committed; ``rows``: every committed row, ``row`` last."""

    def close(self) -> None: ...


LoggerFactory = Callable[[Path, Any, list[dict[str, Any]]], MetricLogger]
LOGGERS: Registry[LoggerFactory] = Registry("logger")
# Package each logger imports, and how to install it.
REQUIRES = {"tensorboard": ("tensorboard", "pip install 'fedguide[logging]' (or pip install tensorboard)"),
            "wandb": ("wandb", "pip install wandb")}


def scalars(row: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in row.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(scalars(value, f"{name}/"))
        elif isinstance(value, bool):
            out[name] = int(value)
        elif value is None or isinstance(value, (int, float, str)):
            out[name] = value
    return out


def numbers(row: Mapping[str, Any]) -> dict[str, float]:
    return {k: v for k, v in scalars(row).items() if isinstance(v, (int, float))}


def check_available(names: Iterable[str]) -> None:
    for name in names:
        LOGGERS.get(name)
        if name in REQUIRES:
            module, install = REQUIRES[name]
            try:
                importlib.import_module(module)
            except ImportError:
                raise ConfigError(f"logging: {name} needs the {module} package, which is not installed; "
                                  f"{install}, or remove {name} from logging") from None


@LOGGERS.register("csv", summary="metrics.csv beside metrics.jsonl: one row per round, scalar columns")
class CsvLogger:
    def __init__(self, run_dir: Path, cfg: Any, rows: list[dict[str, Any]]):
        self.path = Path(run_dir) / "metrics.csv"
        if rows:
            self._write(rows)

    def log(self, row: dict[str, Any], rows: list[dict[str, Any]]) -> None:
        self._write(rows)

    def _write(self, rows: list[dict[str, Any]]) -> None:
        flat = [scalars(r) for r in rows]
        columns = list(dict.fromkeys(key for r in flat for key in r))  # in the order they first appear
        text = io.StringIO()
        writer = csv.DictWriter(text, fieldnames=columns, restval="", lineterminator="\n")
        writer.writeheader()
        writer.writerows({k: ("" if v is None else v) for k, v in r.items()} for r in flat)
        write_text(self.path, text.getvalue())

    def close(self) -> None:
        return None


@LOGGERS.register("tensorboard", summary="TensorBoard event files under <run>/tensorboard/")
class TensorBoardLogger:
    def __init__(self, run_dir: Path, cfg: Any, rows: list[dict[str, Any]]):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"), purge_step=1 if rows else None)
        for row in rows:
            self._add(row)
        self.writer.flush()

    def _add(self, row: dict[str, Any]) -> None:
        for tag, value in numbers(row).items():
            if tag != "round":
                self.writer.add_scalar(tag, value, global_step=row["round"])

    def log(self, row: dict[str, Any], rows: list[dict[str, Any]]) -> None:
        self._add(row)
        self.writer.flush()  # a killed run keeps every round it committed

    def close(self) -> None:
        self.writer.close()


@LOGGERS.register("wandb", summary="a Weights & Biases run (WANDB_PROJECT, default fedguide)")
class WandbLogger:
    def __init__(self, run_dir: Path, cfg: Any, rows: list[dict[str, Any]]):
        import wandb

        folder = Path(run_dir) / "wandb"
        id_file = folder / "fedguide-run-id"
        continued = id_file.is_file()
        run_id = id_file.read_text().strip() if continued else uuid.uuid4().hex[:12]
        if not continued:
            write_text(id_file, run_id + "\n")
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "fedguide"), name=Path(run_dir).name,
                              id=run_id, resume="allow", dir=str(run_dir),
                              config=cfg.model_dump(mode="json"))
        if not continued:
            for row in rows:
                self._add(row)

    def _add(self, row: dict[str, Any]) -> None:
        self.run.log({k: v for k, v in numbers(row).items() if k != "round"}, step=row["round"])

    def log(self, row: dict[str, Any], rows: list[dict[str, Any]]) -> None:
        self._add(row)

    def close(self) -> None:
        self.run.finish()


class MetricLoggers:
    """The loggers of one run, called together; closing closes every one even if one fails."""

    def __init__(self, loggers: Optional[list[MetricLogger]] = None):
        self.loggers = loggers or []

    def log(self, row: dict[str, Any], rows: list[dict[str, Any]]) -> None:
        for logger in self.loggers:
            logger.log(row, rows)

    def close(self) -> None:
        errors = []
        for logger in self.loggers:
            try:
                logger.close()
            except Exception as err:  # the others still close; the first failure is reported after
                errors.append(err)
        self.loggers = []
        if errors:
            raise errors[0]


def open_loggers(names: Iterable[str], run_dir: Path, cfg: Any, rows: list[dict[str, Any]]) -> MetricLoggers:
    """The named loggers of a run, given the rows already committed (empty for a fresh run)."""
    opened = MetricLoggers()
    try:
        for name in dict.fromkeys(names):
            opened.loggers.append(LOGGERS.get(name).obj(Path(run_dir), cfg, list(rows)))
    except BaseException:
        try:
            opened.close()
        except Exception:  # the error that stopped the opening is the one to report
            pass
        raise
    return opened
