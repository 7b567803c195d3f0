"""Progress of long steps (feature extraction, generation, pretraining, a run's rounds) on stderr.

On a terminal (or in Jupyter) a rich bar shows items/s, elapsed and remaining time. Anywhere else (a
log file, a batch job) a bar would print nothing until the step ends, so plain lines are written
instead: one each time ~10 % more of the step is done *and* 30 s have passed since the previous line
(whichever comes later: at most ~10 lines a step, never more than one per 30 s), and a final one::

    image features: 4200/19760 (21%) 23.1 img/s, 11:14 left
    image features: 19760/19760 (100%) 23.0 img/s, 14:19 in all

Output goes to stderr, so a run's stdout (tables, summaries) stays clean; ``enabled=False`` (tests,
``--quiet``) makes it a no-op with the same interface. ``PlainLines`` takes its clock, stream and rule,
so the rule is checked without sleeping.
"""
from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, TextIO


@dataclass(frozen=True)
class Every:
    """When a plain line is due: both this share of the step done and this many seconds passed since the last."""

    fraction: float = 0.1
    seconds: float = 30.0


def clock_text(seconds: float) -> str:
    seconds = max(int(round(seconds)), 0)
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


def rate_text(per_second: float, unit: str) -> str:
    # Slow steps (a diffusion sample, a round) read better as seconds per item than as 0.0x items/s.
    return f"{per_second:.1f} {unit}/s" if per_second >= 1 else f"{1 / per_second:.1f} s/{unit}"


@dataclass
class _Task:
    description: str
    total: int
    unit: str
    started: float
    done: int
    first: int  # items already done when the task began (a resumed step): not counted in the rate
    last_line_done: int
    last_line_time: float


class PlainLines:
    """Plain progress lines, with the part of rich's ``Progress`` interface the engine and the store use:
    ``add_task``, ``update(task, advance=n)``, and use as a context manager."""

    def __init__(self, stream: Optional[TextIO] = None, clock: Callable[[], float] = time.monotonic,
                 every: Every = Every(), unit: str = "it", final: bool = True):
        self.stream, self.clock, self.every, self.unit, self.final = stream, clock, every, unit, final
        self.tasks: list[_Task] = []

    def __enter__(self) -> "PlainLines":
        return self

    def __exit__(self, *exc) -> None:
        return None

    def add_task(self, description: str, total: float, completed: float = 0, unit: Optional[str] = None,
                 **_fields) -> int:
        now = self.clock()
        done = int(completed)
        self.tasks.append(_Task(description, int(total), unit or self.unit, now, done, done, done, now))
        return len(self.tasks) - 1

    def update(self, task_id: int, advance: float = 0, **_fields) -> None:
        task = self.tasks[task_id]
        task.done += int(advance)
        now = self.clock()
        if task.done >= task.total:
            if self.final and task.last_line_done < task.total:
                self._write(f"{self._head(task)} {self._rate(task, now)}{clock_text(now - task.started)} in all")
                task.last_line_done, task.last_line_time = task.done, now
            return
        if (task.done - task.last_line_done >= self.every.fraction * task.total
                and now - task.last_line_time >= self.every.seconds):
            speed = (task.done - task.first) / max(now - task.started, 1e-9)
            left = f"{clock_text((task.total - task.done) / speed)} left" if speed > 0 else "time left unknown"
            self._write(f"{self._head(task)} {self._rate(task, now)}{left}")
            task.last_line_done, task.last_line_time = task.done, now

    @staticmethod
    def _head(task: _Task) -> str:
        return f"{task.description}: {task.done}/{task.total} ({100 * task.done // max(task.total, 1)}%)"

    @staticmethod
    def _rate(task: _Task, now: float) -> str:
        elapsed, new = now - task.started, task.done - task.first
        return f"{rate_text(new / elapsed, task.unit)}, " if new > 0 and elapsed > 0 else ""

    def _write(self, line: str) -> None:
        stream = self.stream if self.stream is not None else sys.stderr  # read late: pytest swaps sys.stderr
        stream.write(line + "\n")
        stream.flush()


def interactive(stream: Optional[TextIO] = None) -> bool:
    """Whether ``stream`` (default stderr) shows a live bar: a terminal or a notebook, as rich decides."""
    from rich.console import Console

    console = Console(file=stream if stream is not None else sys.stderr)
    return console.is_terminal or console.is_jupyter


@contextmanager
def progress(total: int, description: str, enabled: bool = True, unit: str = "img", completed: int = 0,
             lines: Optional[PlainLines] = None) -> Iterator[Callable[[int], None]]:
    """Yields ``advance(n)``: a rich bar on a terminal, else plain lines (``lines`` or stderr's).

    ``completed`` items were done before (a resumed step); the rate counts only the items done here.
    """
    if not enabled:
        yield lambda n=1: None
        return
    if lines is not None or not interactive():
        lines = lines if lines is not None else PlainLines()
        task = lines.add_task(description, total=total, completed=completed, unit=unit)
        yield lambda n=1: lines.update(task, advance=n)
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    start = time.perf_counter()
    done = 0
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=Console(stderr=True)) as bar:
        task = bar.add_task(description, total=total, completed=completed, rate="")

        def advance(n: int = 1) -> None:
            nonlocal done
            done += n
            elapsed = max(time.perf_counter() - start, 1e-9)
            bar.update(task, advance=n, rate=f"{done / elapsed:.1f} {unit}/s")

        yield advance
