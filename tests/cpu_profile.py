"""A pytest plugin that records, for every test, its wall time and the CPU time of the worker process and of
the child processes it waited for (a test's own subprocesses; Ray actors and pool workers it did not wait for
are not counted), one JSON file per xdist worker:

    FEDGUIDE_CPU_PROFILE=/tmp/prof pytest tests -n auto --maxschedchunk 1 -p tests.cpu_profile
    python -m tests.cpu_profile /tmp/prof          # the table: files by wall time, with CPU and the idle rest

Only loaded when named with -p: the suite itself never imports it. Where the suite's time goes is a question of
CPU (two cores) more than of wall time, since most of it is spent in processes a test starts."""
from __future__ import annotations

import json
import os
import resource
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest

_rows: list[tuple[str, float, float, float]] = []


def _cpu(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    own, children, t0 = _cpu(resource.RUSAGE_SELF), _cpu(resource.RUSAGE_CHILDREN), time.perf_counter()
    yield
    _rows.append((item.nodeid, time.perf_counter() - t0, _cpu(resource.RUSAGE_SELF) - own,
                  _cpu(resource.RUSAGE_CHILDREN) - children))


def pytest_sessionfinish(session):
    folder = os.environ.get("FEDGUIDE_CPU_PROFILE")
    if not folder or not _rows:  # the xdist controller runs no test
        return
    Path(folder).mkdir(parents=True, exist_ok=True)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    (Path(folder) / f"{worker}.json").write_text(json.dumps(_rows))


def table(folder: Path, top: int = 30) -> str:
    per_file: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
    rows = [r for f in sorted(folder.glob("*.json")) for r in json.loads(f.read_text())]
    for nodeid, wall, own, children in rows:
        cell = per_file[nodeid.split("::")[0]]
        cell[0] += wall
        cell[1] += own
        cell[2] += children
    total = [sum(r[i] for r in rows) for i in (1, 2, 3)]
    lines = [f"{len(rows)} tests: {total[0]:.1f} s of test wall time, {total[1]:.1f} s CPU in the workers, "
             f"{total[2]:.1f} s CPU in the child processes they waited for",
             "| file | wall s | worker CPU s | children CPU s | wall - CPU s |", "|---|---:|---:|---:|---:|"]
    for path, (wall, own, children) in sorted(per_file.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"| {path} | {wall:.1f} | {own:.1f} | {children:.1f} | {wall - own - children:.1f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m tests.cpu_profile FOLDER (the FEDGUIDE_CPU_PROFILE folder of a run)")
    print(table(Path(sys.argv[1])))
