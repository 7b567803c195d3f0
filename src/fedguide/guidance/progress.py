"""A progress bar for long frozen-model work (feature extraction, generation) that reports items/s.

The bar goes to stderr through rich, so a run's stdout (tables, summaries) stays clean; ``enabled=False``
(tests, ``--quiet``) makes it a no-op with the same interface.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Callable, Iterator


@contextmanager
def progress(total: int, description: str, enabled: bool = True, unit: str = "img") -> Iterator[Callable[[int], None]]:
    """Yields ``advance(n)``; on exit the bar shows the overall rate in ``unit``/s."""
    if not enabled:
        yield lambda n=1: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    start = time.perf_counter()
    done = 0
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=Console(stderr=True)) as bar:
        task = bar.add_task(description, total=total, rate="")

        def advance(n: int = 1) -> None:
            nonlocal done
            done += n
            elapsed = max(time.perf_counter() - start, 1e-9)
            bar.update(task, advance=n, rate=f"{done / elapsed:.1f} {unit}/s")

        yield advance
